"""Fleets of gRPC workers in the runner: what a case on them may ask for, what a plane
needs to run it, which divergences hold there, and how engines are counted."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import trio

from conformance.cli import main
from conformance.client import Answer
from conformance.engine_fleet import ACCESS_LINE, GENERATE_LINE, dispatch_line
from conformance.expect import check_answers
from conformance.loader import load_case
from conformance.model import Expect, fleet_capabilities
from conformance.nodes import SpecError
from conformance.planes.python import PythonPlane
from conformance.planes.smg import SmgPlane
from conformance.planes.smg_1_10 import Smg110Plane
from conformance.planes.vllm_router import VllmRouterPlane
from conformance.runner import RunOptions, run_case

GRPC = """\
name: a gRPC case
description: two fake gRPC engines, one failing
fleets: [fake, grpc]
fleet:
  a: {behaviour: {fail_first: 1, fail_mode: reset, fail_after_chunks: 1}}
  b: {dp_size: 2}
steps:
  - send: {count: 2, route: messages}
    expect:
      status: {503: [0, 2], 404: [0, 2]}
      error_code: [no_available_workers, model_not_found]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grpc" / "case.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    (tmp_path / "VERSION").write_text("1\n")
    return path


def test_a_grpc_case_keeps_its_behaviour_ranks_and_code_list(tmp_path: Path) -> None:
    case = load_case(write(tmp_path, GRPC), tmp_path)
    assert case.fleets == frozenset({"fake", "grpc"})
    assert case.worker("a").behaviour["fail_mode"] == "reset"
    assert case.worker("b").dp_size == 2
    (step,) = case.steps
    assert step.expect.error_code == ("no_available_workers", "model_not_found")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (
            GRPC.replace("  b: {dp_size: 2}", "  b: {role: prefill}"),
            "fleet.b",
            "is a prefill worker",
        ),
        (
            GRPC.replace("  b: {dp_size: 2}", "  b: {kv_events: true}"),
            "fleet.b",
            "publishes KV events (kv_events); a gRPC worker (fleets: grpc) cannot",
        ),
        (
            GRPC.replace("  b: {dp_size: 2}", "  b: {lora_adapters: [x]}"),
            "fleet.b",
            "holds LoRA adapters (lora_adapters); a gRPC worker (fleets: grpc) cannot",
        ),
        (
            GRPC.replace("fleets: [fake, grpc]\n", "fleets: [fake, grpc]\ndiscovery: etcd\n"),
            "discovery",
            "a gRPC worker (fleets: grpc) is not discovered",
        ),
        (
            GRPC.replace("route: messages", "route: embeddings"),
            "steps[0]",
            "route embeddings is not served by a gRPC worker",
        ),
        (
            GRPC.replace("route: messages", "worker: a"),
            "steps[0]",
            "takes no HTTP request past the plane",
        ),
        # Real engines over gRPC: the engines' rules, named by their fleet kind.
        (
            GRPC.replace("fleets: [fake, grpc]", "fleets: [vllm-grpc]"),
            "fleet.a",
            "has a scripted behaviour; a real engine (fleets: vllm-grpc) cannot",
        ),
        (
            GRPC.replace("error_code: [", "error_code: [7, "),
            "error_code[0]",
            "must be a non-empty string",
        ),
        (GRPC.replace("[no_available_workers, model_not_found]", "[]"), "error_code", "names no"),
    ],
)
def test_what_a_grpc_fleet_cannot_do_is_refused_where_it_is_asked(
    tmp_path: Path, text: str, field: str, words: str
) -> None:
    with pytest.raises(SpecError) as refused:
        load_case(write(tmp_path, text), tmp_path)
    assert refused.value.field.endswith(field), refused.value
    assert words in str(refused.value)


def test_an_error_code_list_accepts_any_of_its_codes() -> None:
    expect = Expect(error_code=("no_available_workers", "model_not_found"))
    both = [
        Answer(503, body=b'{"error": {"code": "no_available_workers"}}'),
        Answer(404, body=b'{"error": {"code": "model_not_found"}}'),
    ]
    assert check_answers(expect, both) == []
    other = [Answer(500, body=b'{"error": {"code": "start_generation_failed"}}')]
    (line,) = check_answers(expect, other)
    assert line.startswith(
        "error_code: expected one of 'no_available_workers', 'model_not_found' on every answer, 1 of 1"
    )


def test_a_grpc_fleet_needs_a_grpc_path_and_reads_that_paths_divergences() -> None:
    assert fleet_capabilities("grpc") == fleet_capabilities("vllm-grpc") == {"upstream.grpc"}
    assert fleet_capabilities("fake") == fleet_capabilities("vllm") == frozenset()
    smg = SmgPlane()
    assert "upstream.grpc" in smg.capabilities
    assert (
        smg.divergence_file("grpc") == smg.divergence_file("vllm-grpc") == SmgPlane.grpc_divergences
    )
    assert smg.divergence_file("fake") == smg.divergence_file("vllm") == SmgPlane.divergences
    assert Smg110Plane().divergence_file("fake") is None
    assert "upstream.grpc" not in VllmRouterPlane.capabilities


async def test_a_plane_without_a_grpc_path_reports_every_grpc_case_unsupported(
    tmp_path: Path,
) -> None:
    case = load_case(write(tmp_path, GRPC), tmp_path)
    with trio.fail_after(10):
        outcome = await run_case(case, VllmRouterPlane(), {}, RunOptions(fleet="grpc"))
    assert outcome.verdict == "unsupported"
    assert outcome.detail.startswith("needs upstream.grpc (upstream.grpc: no gRPC path")
    assert outcome.seconds == 0.0  # nothing was started


def test_our_plane_runs_grpc_cases_with_its_own_divergence_list() -> None:
    plane = PythonPlane()
    assert "upstream.grpc" in plane.capabilities
    assert plane.divergence_file("grpc") == plane.divergence_file("vllm-grpc")
    assert plane.divergence_file("grpc") == PythonPlane.grpc_divergences
    assert plane.divergence_file("fake") == PythonPlane.divergences


def test_a_grpc_engine_counts_each_generate_call_it_logs() -> None:
    received = (
        "(MainProcess pid=20232) INFO 12-05 07:58:25 [servicer.py:408] Generate request x5: "
        "input_type=tokenized, stream=False, preprocessed_mm=False, media_refs=0, dp_rank=3"
    )
    refused = (
        "(MainProcess pid=20232) WARNING 12-05 07:58:25 [servicer.py:643] Generate request x5 "
        "rejected (INVALID_ARGUMENT): data_parallel_rank 3 is out of range [0, 1)."
    )
    assert dispatch_line("grpc") is GENERATE_LINE and dispatch_line("http") is ACCESS_LINE
    assert GENERATE_LINE.search(received) and not GENERATE_LINE.search(refused)


def test_list_on_a_grpc_fleet_shows_what_a_run_there_would_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["list", "--fleet", "grpc", "--plane", "python", "--plane", "smg"]
    assert main([*argv, "--case", "classification/*-404", "--case", "failover/unreachable*"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert lines == [
        "classification/unknown-model-404                 [classification] python: runs; smg: runs",
        "failover/unreachable-is-502                      [failover,classification] "
        "python: runs; smg: divergent",
        "2 case(s)",
    ]

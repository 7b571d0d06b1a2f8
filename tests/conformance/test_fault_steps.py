"""Fault steps, the `streaming` step and the fleet kinds a case can run on: what the
schema reads and refuses, and where a real-engine run's report goes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.loader import load_case
from conformance.model import FaultStep, StreamingStep
from conformance.publish import PlaneReport, load_report, parity_markdown, report_path, write_report

ENGINES = """\
name: a fault case
description: kill a worker while it streams
fleets: [fake, vllm]
fleet:
  a: {}
  b: {}
steps:
  - send: {count: 2, stream: true, background: long}
  - streaming: long
  - fault: {worker: a, action: kill}
  - fault: {worker: [a, b], action: restart}
  - await: long
    expect: {status: 200}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "faults" / "case.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    (tmp_path / "VERSION").write_text("1\n")
    return path


def test_fault_and_streaming_steps_and_the_fleet_kinds_load(tmp_path: Path) -> None:
    case = load_case(write(tmp_path, ENGINES), tmp_path)
    assert case.fleets == frozenset({"fake", "vllm"})
    _, streaming, kill, restart, _ = case.steps
    assert isinstance(streaming, StreamingStep) and streaming.name == "long"
    assert isinstance(kill, FaultStep) and (kill.action, kill.workers) == ("kill", ("a",))
    assert isinstance(restart, FaultStep) and restart.workers == ("a", "b")
    without = ENGINES.replace("fleets: [fake, vllm]\n", "")
    assert load_case(write(tmp_path, without), tmp_path).fleets == frozenset({"fake"})


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        (
            ENGINES.replace("action: kill", "action: explode"),
            10,
            "steps[2].fault.action",
            "one of kill, stop, resume, restart",
        ),
        (
            ENGINES.replace("worker: a, action: kill", "worker: c, action: kill"),
            10,
            "steps[2].fault.worker",
            "no worker 'c'",
        ),
        (
            ENGINES.replace("streaming: long", "streaming: short"),
            9,
            "steps[1].streaming",
            "no background send 'short'",
        ),
        (
            ENGINES.replace("fleets: [fake, vllm]", "fleets: [fake, gpu]"),
            3,
            "fleets[1]",
            "one of fake, vllm",
        ),
        (ENGINES.replace("fleets: [fake, vllm]", "fleets: []"), 3, "fleets", "names no fleet kind"),
        # What a real engine cannot do, each refused at the worker or step that asks.
        (
            ENGINES.replace("  a: {}", "  a: {behaviour: {fail_first: 1}}"),
            5,
            "fleet.a",
            "has a scripted behaviour; a real engine (fleets: vllm) cannot",
        ),
        (ENGINES.replace("  b: {}", "  b: {role: prefill}"), 6, "fleet.b", "is a prefill worker"),
        (ENGINES.replace("  b: {}", "  b: {dp_size: 2}"), 6, "fleet.b", "has dp_size 2"),
        (ENGINES.replace("  b: {}", "  b: {model: other}"), 6, "fleet.b", "serves 'other'"),
        (
            ENGINES.replace("  b: {}", "  b: {kv_events: true}"),
            6,
            "fleet.b",
            "publishes KV events (kv_events); a real engine (fleets: vllm) cannot",
        ),
        (
            ENGINES.replace("  b: {}", "  b: {lora_adapters: []}"),
            6,
            "fleet.b",
            "holds LoRA adapters (lora_adapters); a real engine (fleets: vllm) cannot",
        ),
        (
            ENGINES.replace("  b: {}", "  b: {kv_events: sometimes}"),
            6,
            "fleet.b.kv_events",
            "must be true or false",
        ),
        # A request sent to a worker itself, past the plane.
        (
            ENGINES.replace("  - fault: {worker: a, action: kill}", "  - send: {worker: c}"),
            10,
            "steps[2].send.worker",
            "'c' is not a worker of the fleet",
        ),
        (
            ENGINES.replace("background: long}", "background: long, worker: a}"),
            8,
            "steps[0].send.worker",
            "is not a background send",
        ),
        (
            ENGINES.replace("fleets: [fake, vllm]\n", "fleets: [fake, vllm]\nmodel: other\n"),
            4,
            "model",
            "a vllm fleet serves 'm' only",
        ),
        (
            ENGINES.replace(
                "  - streaming: long", "  - set_behaviour: {worker: a, behaviour: {healthy: false}}"
            ),
            9,
            "steps[1].set_behaviour",
            "no scripted behaviour",
        ),
    ],
)
def test_a_bad_fault_case_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, field: str, words: str
) -> None:
    path = write(tmp_path, text)
    assert main(["--spec", str(tmp_path), "validate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:{line}: {field}: "), err
    assert words in err


def test_a_real_engine_report_has_its_own_file_and_column(tmp_path: Path) -> None:
    fake = PlaneReport("smg", "1.13.0", "2026-12-01", "1", "conformance run", ())
    vllm = PlaneReport("smg", "1.13.0", "2026-12-01", "1", "conformance run", (), fleet="vllm")
    assert report_path(tmp_path, fake) == tmp_path / "smg" / "1.13.0.yaml"
    assert report_path(tmp_path, vllm) == tmp_path / "smg" / "1.13.0-vllm.yaml"
    assert load_report(write_report(tmp_path, vllm)).fleet == "vllm"
    assert load_report(write_report(tmp_path, fake)).fleet == "fake"
    matrix = parity_markdown([fake, vllm], "two reports")
    assert "| case | smg 1.13.0 | smg 1.13.0 on vllm |" in matrix
    assert "| smg | 1.13.0 | vllm |" in matrix


def test_a_report_keeps_its_runs_wall_time_and_an_unknown_one_says_so(tmp_path: Path) -> None:
    timed = PlaneReport("smg", "1.13.0", "2026-12-01", "1", "run", (), run_seconds=714.2)
    untimed = PlaneReport("smg", "1.12.0", "2026-11-30", "1", "run", ())
    assert load_report(write_report(tmp_path, timed)).run_seconds == 714.0
    matrix = parity_markdown([timed, untimed], "two reports")
    assert "| smg | 1.13.0 | fake | 2026-12-01 | 1 | 714 |" in matrix
    assert "| smg | 1.12.0 | fake | 2026-11-30 | 1 | ? |" in matrix  # unknown, not 0

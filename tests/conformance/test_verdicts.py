"""Pure parts of the runner: expectations against answers, and verdicts against the
divergence list."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from conformance.client import Answer, stream_end
from conformance.divergences import Divergence, load_divergences, unknown_cases
from conformance.expect import WorkerView, check_answers, check_handoffs, check_workers
from conformance.model import (
    Case,
    Expect,
    HandoffCheck,
    HeaderCheck,
    Range,
    RouterSettings,
    WaitStep,
    WorkerSpec,
)
from conformance.runner import judge


def case(*workers: WorkerSpec) -> Case:
    return Case(
        "x/y",
        Path("x/y.yaml"),
        "n",
        "d",
        (),
        frozenset(),
        workers,
        RouterSettings(),
        (WaitStep(1, 1.0),),
    )


def test_status_counts_are_strict() -> None:
    answers = [Answer(200), Answer(200), Answer(503)]
    assert check_answers(Expect(status={200: Range(2, 2), 503: Range(1, 1)}), answers) == []
    [line] = check_answers(Expect(status={200: Range(3, 3)}), answers)
    assert "200: expected 3, got 2" in line
    assert "503: expected none, got 1" in line


def test_headers_and_error_code_apply_to_every_answer() -> None:
    body = b'{"error": {"message": "all 2 workers are draining", "type": "t", "code": "no_available_workers"}}'
    good = Answer(503, {"retry-after": "2"}, body)
    bad = Answer(503, {"retry-after": "0"}, body.replace(b"no_available", b"other"))
    expect = Expect(
        error_code="no_available_workers",
        message_contains=("Draining",),
        headers={"retry-after": HeaderCheck(int_min=1)},
    )
    assert check_answers(expect, [good]) == []
    lines = check_answers(expect, [good, bad])
    assert len(lines) == 2
    assert lines[0].startswith(
        "error_code: expected 'no_available_workers' on every answer, 1 of 2"
    )
    assert lines[1].startswith(
        "headers[retry-after]: expected an integer >= 1 on every answer, 1 of 2 had {'0': 1}"
    )


def test_stream_end_tells_done_error_and_truncated_apart() -> None:
    head = b'data: {"choices": []}\n\n'
    assert stream_end(Answer(200, body=head + b"data: [DONE]\n\n")) == "done"
    assert stream_end(Answer(200, body=head + b'event: error\ndata: {"error": {}}\n\n')) == "error"
    assert (
        stream_end(
            Answer(200, body=head + b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n')
        )
        == "error"
    )
    assert stream_end(Answer(200, body=head, transport_error="RemoteProtocolError")) == "truncated"


def test_dispatch_counts_per_worker_and_for_the_whole_fleet() -> None:
    c = case(WorkerSpec("a"), WorkerSpec("b"))
    view = WorkerView(delta={"a": 3, "b": 5}, total={"a": 4, "b": 5}, handoffs={})
    assert check_workers(Expect(dispatches={"a": Range(3, 3), "all": Range(8, 8)}), c, view) == []
    lines = check_workers(
        Expect(dispatches={"b": Range(0, 4)}, dispatches_total={"a": Range(3, 3)}), c, view
    )
    assert lines == [
        "dispatches[b]: expected [0, 4], got 5 (per worker: {a: 3, b: 5})",
        "dispatches_total[a]: expected 3, got 4 (per worker: {a: 4, b: 5})",
    ]


def test_busiest_is_whichever_worker_received_the_most() -> None:
    c = case(WorkerSpec("a"), WorkerSpec("b"))
    view = WorkerView(delta={"a": 0, "b": 6}, total={"a": 2, "b": 6}, handoffs={})
    assert check_workers(Expect(dispatches={"busiest": Range(6, 6)}), c, view) == []
    assert check_workers(Expect(dispatches_total={"busiest": Range(0, 5)}), c, view) == [
        "dispatches_total[busiest]: expected [0, 5], got 6 (per worker: {a: 2, b: 6})"
    ]


def test_rooms_must_match_across_legs_and_name_the_prefill_rank() -> None:
    c = case(
        WorkerSpec("p", role="prefill", dp_size=4, bootstrap_port=9000),
        WorkerSpec("d", role="decode"),
    )
    good: dict[str, list[dict[str, Any]]] = {
        "p": [{"bootstrap_room": 4 * 7 + 2, "dp_rank_header": "2", "bootstrap_port": 9000}],
        "d": [{"bootstrap_room": 4 * 7 + 2, "disagg_prefill_dp_rank": 2, "bootstrap_port": 9000}],
    }
    assert check_handoffs(HandoffCheck(rooms_match=True, room_matches_rank=True), c, good) == []
    wrong_rank: dict[str, list[dict[str, Any]]] = {
        "p": [{"bootstrap_room": 29, "dp_rank_header": None, "bootstrap_port": 9000}],
        "d": [{"bootstrap_room": 30, "disagg_prefill_dp_rank": 0, "bootstrap_port": 9000}],
    }
    lines = check_handoffs(HandoffCheck(rooms_match=True, room_matches_rank=True), c, wrong_rank)
    assert lines[0].startswith(
        "handoffs.rooms_match: the legs saw different rooms (prefill only: [29], decode only: [30])"
    )
    assert lines[1].startswith("handoffs.room_matches_rank: 2 of 2 rooms wrong")
    assert "no rank for room 29" in lines[1]
    assert "room 30 % 4 = 2, rank 0" in lines[1]


def test_verdicts_against_the_divergence_list() -> None:
    listed = Divergence("x/y", "answers 503", "by design", re.compile(r"status: 404"))
    assert judge("x/y", "p", [], None, 1.0).verdict == "pass"
    assert judge("x/y", "p", ["status: 404: expected 1, got 0"], None, 1.0).verdict == "fail"
    assert judge("x/y", "p", ["status: 404: expected 1, got 0"], listed, 1.0).verdict == "divergent"
    # A listed case that starts passing makes the list untrue: an error.
    assert judge("x/y", "p", [], listed, 1.0).verdict == "stale"
    # Failing some other way than recorded is a plain failure.
    assert judge("x/y", "p", ["dispatches[a]: expected 1, got 2"], listed, 1.0).verdict == "fail"


def test_a_divergence_file_is_checked_like_a_case(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(
        "x/y:\n  observed: answers 503\n  reason: by design\nx/gone:\n  observed: o\n  reason: r\n"
    )
    divergences = load_divergences(path)
    assert sorted(divergences) == ["x/gone", "x/y"]
    [error] = unknown_cases(path, divergences, {"x/y"})
    assert str(error) == f"{path}:4: x/gone: no such case"
    path.write_text("x/y:\n  observed: answers 503\n")
    try:
        load_divergences(path)
    except ValueError as exc:
        assert str(exc) == f"{path}:2: x/y.reason: is required"
    else:
        raise AssertionError("a divergence without a reason was accepted")


def test_the_report_shows_every_verdict_in_markdown_and_junit() -> None:
    import xml.etree.ElementTree as ET

    from conformance.report import RunInfo, junit, markdown
    from conformance.runner import Outcome

    outcomes = [
        Outcome("x/y", "one", "pass", seconds=1.0),
        Outcome("x/y", "two", "stale", "listed but passes", seconds=2.0),
    ]
    info = RunInfo(
        {"one": "1.0", "two": "2.0"},
        {"one": frozenset({"pd"}), "two": frozenset()},
        "conformance run",
        3.0,
        4,
        "7",
    )
    text = markdown(outcomes, info)
    assert "| case | one 1.0 | two 2.0 |" in text
    assert "| `x/y` | pass | **STALE** |" in text
    assert "| `pd` | yes | no |" in text
    assert "- **two 2.0** `x/y` (stale): listed but passes" in text
    assert "Spec version 7" in text
    root = ET.fromstring(junit(outcomes, info))
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert suites["conformance.one"].get("failures") == "0"
    assert suites["conformance.two"].get("failures") == "1"
    failure = suites["conformance.two"].find("testcase/failure")
    assert failure is not None and failure.get("type") == "stale"


def test_a_plane_is_named_or_imported_as_module_and_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from conformance.cli import main
    from conformance.planes import resolve_plane

    assert resolve_plane("smg").name == "smg"
    assert (
        resolve_plane("tests.conformance.test_suite_can_fail:BreakerOff").name
        == "python-breaker-off"
    )
    with pytest.raises(ValueError, match="unknown plane 'vllm'"):
        resolve_plane("vllm")
    assert main(["run", "--plane", "vllm"]) == 2
    assert "unknown plane 'vllm'" in capsys.readouterr().err
    assert resolve_plane("vllm-router").name == "vllm-router"


def test_list_says_what_each_plane_makes_of_a_case(capsys: pytest.CaptureFixture[str]) -> None:
    from conformance.cli import main

    spec = Path(__file__).resolve().parents[2] / "spec"
    assert (
        main(
            [
                "--spec",
                str(spec),
                "list",
                "--case",
                "breaker/single-probe-under-concurrency",
                "--case",
                "pd/unknown-model-404",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "breaker/single-probe-under-concurrency" in out
    assert "python: runs; smg: unsupported; vllm-router: unsupported" in out
    assert "python: runs; smg: divergent; vllm-router: divergent" in out
    assert out.rstrip().endswith("2 case(s)")

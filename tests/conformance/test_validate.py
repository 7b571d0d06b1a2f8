"""`conformance validate` names the file, the line and the field of what is wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.loader import load_case

GOOD = """\
name: a good case
description: two workers, one request
fleet:
  a: {}
  b: {}
steps:
  - send: {count: 2}
    expect:
      status: {200: 2}
      dispatches: {a: 1, b: [0, 1]}
"""


def write(tmp_path: Path, text: str, name: str = "case.yaml") -> Path:
    path = tmp_path / "breaker" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["--spec", str(tmp_path), "validate"])
    return code, capsys.readouterr().err


def test_a_good_case_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, GOOD)
    code, err = validate(tmp_path, capsys)
    assert (code, err) == (0, "")
    case = load_case(path, tmp_path)
    assert case.id == "breaker/case"
    assert [w.name for w in case.fleet] == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        # A typo in a field name, with a suggestion.
        (GOOD.replace("  a: {}", "  a:\n    behavior: {fail_first: 1}"), 5, "fleet.a.behavior", "did you mean 'behaviour'"),
        # A wrong type, reported at the value's own line.
        (GOOD.replace("count: 2", "count: two"), 7, "steps[0].send.count", "must be an integer"),
        # A worker the fleet does not have.
        (GOOD.replace("b: [0, 1]", "c: 1"), 10, "steps[0].expect.dispatches.c", "no worker 'c'"),
        # A range upside down.
        (GOOD.replace("[0, 1]", "[3, 1]"), 10, "steps[0].expect.dispatches.b", "max 1 is below min 3"),
        # Not an HTTP status.
        (GOOD.replace("{200: 2}", "{ok: 2}"), 9, "steps[0].expect.status.ok", "HTTP status"),
        # A required field missing: reported at the mapping that lacks it.
        (GOOD.replace("description: two workers, one request\n", ""), 1, "description", "is required"),
        # The same key twice.
        (GOOD.replace("  b: {}", "  b: {}\n  a: {}"), 6, "fleet.a", "given twice"),
        # A behaviour value out of range.
        (GOOD.replace("  a: {}", "  a:\n    behaviour: {fail_status: 200}"), 5, "fleet.a.behaviour.fail_status", "400"),
        # stream_end on a request that does not stream.
        (GOOD.replace("status: {200: 2}", "stream_end: done"), 9, "steps[0].expect.stream_end", "stream: true"),
        # A step with two actions.
        (GOOD.replace("  - send: {count: 2}", "  - wait: 1\n    send: {count: 2}"), 7, "steps[0]", "exactly one of"),
        # `busiest` names no worker: a worker may not take the name.
        (GOOD.replace("  b: {}", "  busiest: {}"), 5, "fleet.busiest", "reserved"),
        # A cache threshold is a share of the prompt.
        (GOOD.replace("fleet:", "settings:\n  cache_aware: {cache_threshold: 1.5}\nfleet:"), 4, "settings.cache_aware.cache_threshold", "between 0 and 1"),
        # Broken YAML.
        (GOOD.replace("fleet:", "fleet: [unclosed"), 4, "", "not valid YAML"),
    ],
)
def test_a_bad_case_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, field: str, words: str
) -> None:
    path = write(tmp_path, text)
    code, err = validate(tmp_path, capsys)
    assert code == 2
    prefix = f"{path}:{line}: {field}: " if field else f"{path}:{line}: "
    assert err.startswith(prefix), err
    assert words in err


def test_every_bad_file_is_reported_and_good_ones_still_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, GOOD, "good.yaml")
    first = write(tmp_path, GOOD.replace("count: 2", "count: -1"), "bad1.yaml")
    second = write(tmp_path, GOOD.replace("route", "x").replace("send: {count: 2}", "send: {route: grpc}"), "bad2.yaml")
    code = main(["--spec", str(tmp_path), "validate"])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"{first}:7: steps[0].send.count: must be >= 1" in err
    assert f"{second}:7: steps[0].send.route: must be one of chat, completions, generate" in err
    assert "1 valid case(s), 2 error(s)" in out


def test_the_repository_spec_and_divergence_files_are_valid(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    count = int(out.split()[0])
    assert count >= 25

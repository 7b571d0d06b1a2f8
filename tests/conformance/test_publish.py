"""Publishable reports: one YAML file per plane and version, and the parity matrix made
from those files alone."""

from __future__ import annotations

import datetime
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from conformance.cli import main
from conformance.client import NESTED_FIELD, PADDING_FIELD, raw_bytes
from conformance.model import RawBody, RequestSpec
from conformance.publish import (
    ReportError,
    build_report,
    load_report,
    load_reports,
    parity_markdown,
    write_report,
)
from conformance.runner import Outcome

OUTCOMES = [
    Outcome("a/one", "p", "pass", seconds=1.0),
    Outcome(
        "a/two",
        "p",
        "divergent",
        "answers 503 instead of 404",
        ["step 1 send: status: 404: expected 2, got 0"],
    ),
    Outcome("a/three", "p", "fail", "", ["step 2 send: dispatches[a]: expected 1, got 2"]),
    Outcome("a/one", "q", "unsupported", "needs pd.nixl"),
]


def test_a_report_names_plane_version_date_spec_and_every_verdict(tmp_path: Path) -> None:
    report = build_report(
        "p", "1.2.3", {"pd"}, OUTCOMES, "4", "conformance run", datetime.date(2026, 11, 30)
    )
    path = write_report(tmp_path, report)
    assert path == tmp_path / "p" / "1.2.3.yaml"
    data = yaml.safe_load(path.read_text())
    assert {k: data[k] for k in ("plane", "version", "date", "spec_version", "capabilities")} == {
        "plane": "p",
        "version": "1.2.3",
        "date": "2026-11-30",
        "spec_version": "4",
        "capabilities": ["pd"],
    }
    assert data["summary"] == {
        "pass": 1,
        "divergent": 1,
        "unsupported": 0,
        "fail": 1,
        "stale": 0,
        "error": 0,
    }
    cases = {case["id"]: case for case in data["cases"]}
    assert cases["a/one"] == {"id": "a/one", "verdict": "pass", "seconds": 1.0}
    assert cases["a/two"]["observed"] == "answers 503 instead of 404"
    assert cases["a/three"]["failures"] == ["step 2 send: dispatches[a]: expected 1, got 2"]
    assert load_report(path) == report


def test_the_parity_matrix_is_made_from_report_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for plane, version in (("p", "1.2.3"), ("q", "0.1")):
        write_report(
            tmp_path, build_report(plane, version, set(), OUTCOMES, "4", "conformance run")
        )
    reports = load_reports(tmp_path)
    assert [(r.plane, r.version) for r in reports] == [("p", "1.2.3"), ("q", "0.1")]
    text = parity_markdown(reports, "here")
    assert "| case | p 1.2.3 | q 0.1 |" in text
    assert "| `a/one` | pass | unsupported |" in text
    assert "- **p 1.2.3** `a/two` (divergent): answers 503 instead of 404" in text
    assert "- **q 0.1** `a/one` (unsupported): needs pd.nixl" in text
    out = tmp_path / "parity.md"
    assert main(["parity", str(tmp_path), "--out", str(out)]) == 0
    assert "| `a/three` | **FAIL** |  |" in out.read_text()
    # A file that is not a report is named, not skipped.
    (tmp_path / "q" / "bad.yaml").write_text("plane: q\n")
    with pytest.raises(ReportError, match=r"bad\.yaml"):
        load_reports(tmp_path)
    assert main(["parity", str(tmp_path)]) == 2
    assert "bad.yaml" in capsys.readouterr().err


def test_a_run_writes_one_report_per_plane(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec"
    (spec / "s").mkdir(parents=True)
    (spec / "VERSION").write_text("9\n")
    (spec / "s" / "ok.yaml").write_text(
        textwrap.dedent("""
        name: ok
        description: served
        fleet: {a: {}}
        steps:
          - send: {count: 1}
            expect: {status: 200}
    """)
    )
    reports = tmp_path / "reports"
    code = main(
        [
            "--spec",
            str(spec),
            "run",
            "--plane",
            "tests.conformance.stub_planes:StubPlane",
            "--report-yaml",
            str(reports),
        ]
    )
    assert code == 0, capsys.readouterr()
    report = load_report(reports / "stub" / "0.0.1.yaml")
    assert (report.plane, report.version, report.spec_version) == ("stub", "0.0.1", "9")
    assert [(case.id, case.verdict) for case in report.cases] == [("s/ok", "pass")]


def test_raw_bodies_are_the_bytes_the_case_describes() -> None:
    request = RequestSpec()
    assert raw_bytes(RawBody(text="not json"), request, "m") == b"not json"
    deep = json.loads(raw_bytes(RawBody(nested=300), request, "m"))
    depth, value = 0, deep[NESTED_FIELD]
    while value:
        depth, value = depth + 1, value[0]
    assert (deep["model"], depth) == ("m", 299)  # 300 lists, the innermost one empty
    padded = raw_bytes(RawBody(size=5000), request, "m")
    assert len(padded) == 5000
    assert json.loads(padded)[PADDING_FIELD].startswith("aaa")

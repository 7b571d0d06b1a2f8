"""The classification cases on the gRPC path, run the way `make conformance-grpc` runs the
whole gRPC fleet: `conformance run --fleet grpc` with our plane, smg and smg 1.10.0 in one
run, reports written.

Our plane has no gRPC path yet, so every case is unsupported there. smg passes every case
it supports but its listed gRPC divergences, #2465's included (a known model whose
workers are all unavailable is 503, not 404). smg 1.10.0, which predates #2465, diverges
on exactly those cases, with the 404; the run still exits 0 because its divergences are
listed, and the reports say which is which.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from conformance.divergences import load_divergences
from conformance.loader import load_cases, select_cases
from conformance.planes.smg import SmgPlane
from conformance.planes.smg_1_10 import Smg110Plane

ROOT = Path(__file__).resolve().parents[2]
SELECTION = (
    "classification/*",
    "breaker/all-open-reject",
    "faults/all-killed-503-unknown-model-404",
)
# Known model, every worker unavailable: smg #2465's cases.
UNAVAILABLE = {
    "classification/all-unhealthy-503",
    "classification/only-worker-unhealthy-503",
    "classification/restarting-worker-503",
    "classification/stopped-worker-503",
    "breaker/all-open-reject",
}
SUITE_TIMEOUT_S = 400


def selected_ids() -> set[str]:
    root = ROOT / "spec"
    cases = select_cases(load_cases([root], root).cases, SELECTION, [])
    return {case.id for case in cases if "grpc" in case.fleets}


@pytest.mark.smg
def test_the_grpc_path_of_smg_and_of_smg_before_2465(tmp_path: Path) -> None:
    junit, reports = tmp_path / "junit.xml", tmp_path / "reports"
    selection = [arg for pattern in SELECTION for arg in ("--case", pattern)]
    planes = ["--plane", "python", "--plane", "smg", "--plane", "smg-1.10"]
    outputs = ["--junit", str(junit), "--report-yaml", str(reports)]
    command = ["conformance", "run", "--fleet", "grpc", *planes, *selection, "--jobs", "4"]
    result = subprocess.run(
        [sys.executable, "-m", *command, "-v", *outputs],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    verdicts: dict[str, dict[str, ET.Element]] = {}
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        plane = suite.get("name", "").removeprefix("conformance.")
        verdicts[plane] = {case.get("name", ""): case for case in suite.iter("testcase")}
    ids = selected_ids()
    assert UNAVAILABLE <= ids
    assert {plane: set(cases) for plane, cases in verdicts.items()} == {
        "python": ids,
        "smg": ids,
        "smg-1.10": ids,
    }

    def kind(case: ET.Element) -> str:
        skipped = case.find("skipped")
        return "pass" if skipped is None else skipped.get("type", "")

    python = {name: kind(case) for name, case in verdicts["python"].items()}
    assert set(python.values()) == {"unsupported"}
    assert all(
        "needs upstream.grpc" in (case.find("skipped").get("message") or "")  # type: ignore[union-attr]
        for case in verdicts["python"].values()
    )
    smg = {name: kind(case) for name, case in verdicts["smg"].items()}
    listed = set(load_divergences(SmgPlane.grpc_divergences)) & ids
    assert {name for name, v in smg.items() if v == "divergent"} == listed
    assert all(smg[name] == "pass" for name in UNAVAILABLE)
    old = {name: kind(case) for name, case in verdicts["smg-1.10"].items()}
    assert {name for name, v in old.items() if v == "divergent"} == (
        set(load_divergences(Smg110Plane.grpc_divergences)) & ids
    )
    for name in UNAVAILABLE:
        assert old[name] == "divergent"
        failures = verdicts["smg-1.10"][name].find("skipped").get("message")  # type: ignore[union-attr]
        assert "404 model_not_found" in (failures or ""), failures

    report = yaml.safe_load((reports / "smg-1.10" / "1.10.0-grpc.yaml").read_text())
    assert report["fleet"] == "grpc" and report["plane"] == "smg-1.10"
    by_id = {case["id"]: case for case in report["cases"]}
    assert all(
        any("404: expected none, got" in line for line in by_id[name]["failures"])
        for name in UNAVAILABLE
    )
    current = yaml.safe_load((reports / "smg" / "1.13.0-grpc.yaml").read_text())
    assert {case["id"]: case["verdict"] for case in current["cases"]}.items() >= {
        name: "pass" for name in UNAVAILABLE
    }.items()

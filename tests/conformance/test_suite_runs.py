"""The whole suite, run the way CI runs it: `conformance run --plane P --junit F`.

Every case passes on the Python plane but those listed in its divergence file (bugs being
fixed elsewhere); none is unsupported there. On smg and vllm-router every case passes, is
unsupported, or is a divergence listed in `conformance/planes/<plane>_divergences.yaml`;
and every listed divergence still happens (a stale one fails the run).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.divergences import load_divergences
from conformance.loader import load_cases
from conformance.planes.python import PythonPlane
from conformance.planes.smg import SmgPlane
from conformance.planes.vllm_router import VllmRouterPlane

ROOT = Path(__file__).resolve().parents[2]
SUITE_TIMEOUT_S = 400


def run_plane(
    plane: str, tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, ET.Element], str]:
    junit, markdown = tmp_path / "junit.xml", tmp_path / "parity.md"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "run",
            "-v",
            "--plane",
            plane,
            "--jobs",
            "4",
            "--junit",
            str(junit),
            "--report-md",
            str(markdown),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        check=False,
    )
    assert junit.exists(), result.stdout + result.stderr
    cases = {case.get("name", ""): case for case in ET.parse(junit).getroot().iter("testcase")}
    return result, cases, markdown.read_text()


def verdict(case: ET.Element) -> str:
    for tag in ("failure", "error"):
        if case.find(tag) is not None:
            return tag
    skipped = case.find("skipped")
    return "pass" if skipped is None else skipped.get("type", "skipped")


def spec_ids() -> set[str]:
    """Every case a run on fake workers plays: all but those for real engines only."""
    root = ROOT / "spec"
    return {case.id for case in load_cases([root], root).cases if "fake" in case.fleets}


def test_every_case_passes_on_the_python_plane(tmp_path: Path) -> None:
    result, cases, markdown = run_plane("python", tmp_path)
    verdicts = {name: verdict(case) for name, case in cases.items()}
    assert set(verdicts) == spec_ids()
    listed = set(load_divergences(PythonPlane.divergences))
    assert {name for name, v in verdicts.items() if v != "pass"} == listed, result.stdout[-4000:]
    assert {name for name, v in verdicts.items() if v == "divergent"} == listed
    assert result.returncode == 0
    assert "| python | " in markdown


@pytest.mark.parametrize(
    "plane",
    [
        pytest.param(SmgPlane, marks=pytest.mark.smg),
        pytest.param(VllmRouterPlane, marks=pytest.mark.vllm_router),
    ],
    ids=["smg", "vllm-router"],
)
def test_a_peer_plane_passes_or_diverges_as_listed(tmp_path: Path, plane: type[SmgPlane]) -> None:
    result, cases, markdown = run_plane(plane.name, tmp_path)
    verdicts = {name: verdict(case) for name, case in cases.items()}
    assert set(verdicts) == spec_ids()
    assert {
        name for name, v in verdicts.items() if v not in ("pass", "divergent", "unsupported")
    } == set(), result.stdout[-4000:]
    listed = set(load_divergences(plane.divergences))
    assert {name for name, v in verdicts.items() if v == "divergent"} == listed
    unsupported = {name for name, v in verdicts.items() if v == "unsupported"}
    for name in unsupported:
        message = cases[name].find("skipped").get("message", "")  # type: ignore[union-attr]
        # A missing capability, or a setting the adapter says it cannot express, and why.
        assert message.startswith("unsupported: ") and len(message) > len("unsupported: "), message
    # Much of the spec runs on each peer; a plane that "supports" nothing would pass vacuously.
    assert sum(1 for v in verdicts.values() if v == "pass") >= len(verdicts) // 3
    assert result.returncode == 0
    assert "## Divergences" in markdown

"""What a plane author relies on: the whole version string, capabilities that say which
cases will run, settings a plane substitutes while observed, and reports that keep every
failure line (and every runner note) of a case."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import trio
import yaml

from conformance.model import Case, Expect, RequestSpec, RouterSettings, SendStep, WorkerSpec
from conformance.planes.base import Launch
from conformance.publish import build_report, parity_markdown, write_report
from conformance.runner import Outcome, RunOptions, run_case
from tests.conformance.stub_planes import StubPlane


class VersionedPlane(StubPlane):
    def version_argv(self) -> list[str]:
        return [sys.executable, "-c", "print('infera'); print('0.3.1+cpu (build 2026-11-02)')"]


class SubstitutingPlane(StubPlane):
    """Knows only round robin; while observed it runs any policy as round robin."""

    def command(self, launch: Launch) -> list[str]:
        policy = launch.case.settings.policy
        if policy not in (None, "round_robin"):
            launch.substitute("settings.policy", policy, "round_robin", "its only policy")
        return super().command(launch)


def a_case(**settings: object) -> Case:
    step = SendStep(1, RequestSpec(count=2, route="completions"), Expect())
    return Case(
        "x/y",
        Path("x/y.yaml"),
        "n",
        "d",
        (),
        frozenset(),
        (WorkerSpec("a"),),
        dataclasses.replace(RouterSettings(), **settings),  # type: ignore[arg-type]
        (step,),
    )


def test_the_version_is_the_whole_last_line() -> None:
    assert VersionedPlane().version() == "0.3.1+cpu (build 2026-11-02)"


def test_routes_and_the_body_limit_are_capabilities() -> None:
    needed = a_case(max_body_bytes=1024).capabilities_needed()
    assert {"route.completions", "limits.body_size"} <= needed
    assert "route.chat" not in needed


async def test_an_observed_case_says_which_setting_the_plane_substituted() -> None:
    plane = SubstitutingPlane()
    case = dataclasses.replace(
        a_case(policy="random"), steps=(SendStep(1, RequestSpec(), Expect()),)
    )
    with trio.fail_after(60):
        outcome = await run_case(case, plane, {}, RunOptions(run_unsupported=True))
    assert outcome.verdict == "unsupported"
    assert outcome.detail.startswith("needs policy.random")
    assert "substituted settings.policy: random run as round_robin (its only policy)" in (
        outcome.detail
    )


def test_reports_keep_every_failure_line_and_note(tmp_path: Path) -> None:
    lines = [f"step {i} send: dispatches[a]: expected 1, got {i}" for i in range(1, 9)]
    outcomes = [
        Outcome("a/diverges", "p", "divergent", "answers 503 instead of 404", lines),
        Outcome("a/fails", "p", "fail", "", lines[:2], notes=["step 1 send: resent once ..."]),
        Outcome("a/watched", "p", "unsupported", "needs pd (observed: fails)", lines[:3]),
    ]
    report = build_report("p", "1.0", set(), outcomes, "1", "conformance run")
    data = yaml.safe_load(write_report(tmp_path, report).read_text())
    cases = {case["id"]: case for case in data["cases"]}
    assert cases["a/diverges"]["failures"] == lines
    assert cases["a/watched"]["failures"] == lines[:3]
    assert cases["a/fails"]["notes"] == ["step 1 send: resent once ..."]
    text = parity_markdown([report], "here")
    assert "(no detail recorded)" not in text
    assert "- **p 1.0** `a/fails` (fail): 2 failure line(s):" in text
    for line in lines:
        assert f"  - {line}" in text
    assert "## Runner notes" in text

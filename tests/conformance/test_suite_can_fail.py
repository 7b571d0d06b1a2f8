"""The suite can fail: an adapter that maps the case's settings falsely makes the cases
that depend on those settings fail, while a case that does not depend on them passes.

The router itself has no switch for this; the lie is in the test-only adapters below,
which start the real `router serve` with one setting mapped wrongly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from conformance.loader import load_cases, select_cases
from conformance.model import Case
from conformance.planes.python import PythonPlane
from conformance.runner import RunOptions, run_suite

SPEC = Path(__file__).resolve().parents[2] / "spec"


def _override(flags: list[str], flag: str, value: str) -> list[str]:
    out = list(flags)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


class BreakerOff(PythonPlane):
    """Maps every breaker threshold to 0: no breaker at all."""

    name = "python-breaker-off"
    divergences = None

    def settings_flags(self, case: Case) -> list[str]:
        return _override(super().settings_flags(case), "--breaker-failure-threshold", "0")


class SingleAttempt(PythonPlane):
    """Maps every `attempts` to 1: no failover."""

    name = "python-single-attempt"
    divergences = None

    def settings_flags(self, case: Case) -> list[str]:
        return _override(super().settings_flags(case), "--max-attempts", "1")


class OtherPolicy(PythonPlane):
    """Maps every policy to consistent_hash: identical prompts all land on one worker."""

    name = "python-other-policy"
    divergences = None

    def settings_flags(self, case: Case) -> list[str]:
        flags = super().settings_flags(case)
        for flag in ("--policy", "--prefill-policy", "--decode-policy"):
            flags = _override(flags, flag, "consistent_hash")
        return flags


@pytest.mark.parametrize(
    ("plane", "must_fail", "must_pass"),
    [
        (
            BreakerOff(),
            ["breaker/opens-at-threshold", "breaker/probe-after-cooldown", "breaker/all-open-reject",
             "pd/decode-failure-spares-prefill"],
            ["failover/5xx-fails-over"],
        ),
        (
            SingleAttempt(),
            ["failover/5xx-fails-over", "failover/attempts-bound-the-cost",
             "classification/429-fails-over-without-tripping", "failover/reset-fails-over"],
            ["classification/4xx-verbatim-no-failover"],
        ),
        (
            OtherPolicy(),
            ["breaker/success-resets-count", "classification/4xx-verbatim-no-failover",
             "failover/single-attempt-no-retry"],
            ["classification/unknown-model-404"],
        ),
    ],
    ids=["breaker-off", "single-attempt", "other-policy"],
)
async def test_a_falsely_mapped_setting_fails_the_cases_that_depend_on_it(
    plane: PythonPlane, must_fail: list[str], must_pass: list[str]
) -> None:
    loaded = load_cases([SPEC], SPEC)
    assert loaded.errors == []
    cases = select_cases(loaded.cases, [*must_fail, *must_pass], [])
    assert sorted(c.id for c in cases) == sorted([*must_fail, *must_pass])
    with trio.fail_after(120):
        outcomes = await run_suite(cases, [plane], {}, RunOptions(jobs=4))
    verdicts = {o.case_id: o.verdict for o in outcomes}
    assert verdicts == {**{c: "fail" for c in must_fail}, **{c: "pass" for c in must_pass}}, [
        (o.case_id, o.verdict, o.detail, o.failures[:2]) for o in outcomes
    ]
    # Each failure is an expectation that did not hold, not a case that could not run.
    for outcome in outcomes:
        if outcome.verdict == "fail":
            assert outcome.failures and all(line.startswith("step ") for line in outcome.failures)

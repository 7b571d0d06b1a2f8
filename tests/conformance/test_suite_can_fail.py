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


class OwnCountOnly(PythonPlane):
    """Turns the engine load reader off: each process counts only its own requests."""

    name = "python-own-count-only"
    divergences = None

    def settings_flags(self, case: Case) -> list[str]:
        flags = _override(super().settings_flags(case), "--engine-load-interval-s", "0")
        # Two idle workers are a near tie, drawn at random: unseeded, all six requests
        # land on the one the case wants 1 time in 64 and the case passes. This seed
        # sends some to the other.
        return _override(flags, "--policy-seed", "1")


class NoBodyLimit(PythonPlane):
    """Drops `max_body_bytes`: the router keeps its own 32 MiB limit."""

    name = "python-no-body-limit"
    divergences = None

    def settings_flags(self, case: Case) -> list[str]:
        flags = super().settings_flags(case)
        if "--max-body-bytes" in flags:
            at = flags.index("--max-body-bytes")
            del flags[at : at + 2]
        return flags


class NoTrafficPolicy(PythonPlane):
    """Drops the aliases, the fallbacks and the priority classes: one FIFO queue, and model
    names as the workers register them."""

    name = "python-no-traffic-policy"
    divergences = None

    def settings_flags(self, case: Case) -> list[str]:
        flags = super().settings_flags(case)
        for flag in (
            "--model-alias",
            "--model-fallback",
            "--priority-classes",
            "--default-priority",
        ):
            while flag in flags:
                at = flags.index(flag)
                del flags[at : at + 2]
        return flags


@pytest.mark.parametrize(
    ("plane", "must_fail", "must_pass"),
    [
        (
            BreakerOff(),
            [
                "breaker/opens-at-threshold",
                "breaker/probe-after-cooldown",
                "breaker/all-open-reject",
                "pd/decode-failure-spares-prefill",
            ],
            ["failover/5xx-fails-over"],
        ),
        (
            SingleAttempt(),
            [
                "failover/5xx-fails-over",
                "failover/attempts-bound-the-cost",
                "classification/429-fails-over-without-tripping",
                "failover/reset-fails-over",
            ],
            ["classification/4xx-verbatim-no-failover"],
        ),
        (
            OtherPolicy(),
            [
                "breaker/success-resets-count",
                "classification/4xx-verbatim-no-failover",
                "failover/single-attempt-no-retry",
                "kv_aware/blocks-held-elsewhere-attract",
            ],
            ["classification/unknown-model-404"],
        ),
        (NoBodyLimit(), ["raw/oversize-is-413"], ["raw/non-json-is-400"]),
        (OwnCountOnly(), ["load/engine-load-elsewhere-avoided"], ["failover/5xx-fails-over"]),
        (
            NoTrafficPolicy(),
            [
                "traffic/alias-served-by-its-model",
                "traffic/fallback-when-the-model-has-no-worker",
                "traffic/priority-overtakes-queued-lower-class",
            ],
            ["traffic/fallback-never-for-an-unknown-model"],
        ),
    ],
    ids=[
        "breaker-off",
        "single-attempt",
        "other-policy",
        "no-body-limit",
        "own-count-only",
        "no-traffic-policy",
    ],
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


async def test_the_raw_body_cases_fail_on_a_plane_that_answers_500_to_non_json() -> None:
    """The stub router forwards JSON and answers 500 to anything else: the non-JSON case
    fails on it for that reason; the deep-JSON case, which it carries, passes."""
    from tests.conformance.stub_planes import StubPlane

    loaded = load_cases([SPEC], SPEC)
    cases = select_cases(
        loaded.cases, ["raw/non-json-is-400", "raw/oversize-is-413", "raw/deep-json-never-500"], []
    )
    assert len(cases) == 3
    with trio.fail_after(120):
        outcomes = await run_suite(cases, [StubPlane()], {}, RunOptions(jobs=3))
    by_case = {o.case_id: o for o in outcomes}
    assert {case_id: o.verdict for case_id, o in by_case.items()} == {
        "raw/non-json-is-400": "fail",
        # The stub cannot express a body limit; NoBodyLimit above shows this case failing.
        "raw/oversize-is-413": "unsupported",
        "raw/deep-json-never-500": "pass",
    }, outcomes
    non_json = by_case["raw/non-json-is-400"].failures
    assert any("500: expected none, got 2" in line for line in non_json), non_json


class NoDraining(PythonPlane):
    """Publishes every record as ACTIVE: the plane never learns that a worker drains."""

    name = "python-no-draining"
    divergences = None

    async def publish(self, launch, client, worker, status):  # type: ignore[no-untyped-def]
        await super().publish(launch, client, worker, "active")


class NoWithdraw(PythonPlane):
    """Never removes a record: a removed worker stays in the fleet with its old state."""

    name = "python-no-withdraw"
    divergences = None

    async def withdraw(self, launch, client, worker):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize(
    ("plane", "must_fail"),
    [
        (NoDraining(), "discovery/etcd/draining-worker-finishes-in-flight"),
        (NoWithdraw(), "discovery/etcd/removed-worker-breaker-forgotten"),
        (NoWithdraw(), "discovery/etcd/readded-worker-starts-closed"),
    ],
    ids=["draining-ignored", "removal-ignored", "removal-ignored-count"],
)
async def test_the_discovery_cases_fail_when_the_fleet_change_never_reaches_the_plane(
    plane: PythonPlane, must_fail: str
) -> None:
    loaded = load_cases([SPEC], SPEC)
    cases = select_cases(loaded.cases, [must_fail], [])
    with trio.fail_after(120):
        [outcome] = await run_suite(cases, [plane], {}, RunOptions(jobs=1))
    assert outcome.verdict == "fail", outcome
    assert all(line.startswith("step ") for line in outcome.failures)

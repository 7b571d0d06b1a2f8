"""Properties of the per-leg verdict over random fleets.

A fleet is a few workers of model "m" (some also serving "other") and a few of "other"
only, each with a role, a status, a health and a real breaker in some state. The oracle
below decides from first principles what each leg can do; `plan_request` must agree, and
its 503 message must name exactly the legs that block, never a leg that could serve.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.api.errors import ModelNotFound, NoAvailableWorkers
from router.fleet.breaker import BreakerSettings, CircuitBreaker, Outcome
from router.fleet.candidates import AllOpenMode
from router.fleet.records import Mode, Role, Status, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.pipeline.plan import Plan, plan_request

NOW = 1000.0
BREAKER_STATES = ("disabled", "closed", "open", "half_open", "probing")


@dataclass(frozen=True)
class Spec:
    role: Role
    draining: bool
    healthy: bool
    breaker: str
    cooldown_s: float
    also_other: bool


# Weighted towards fit workers, so that pools held back only by their breakers (where
# the all-open mode decides) come up often.
mostly_false = st.sampled_from([False, False, False, True])
specs = st.builds(
    Spec,
    role=st.sampled_from(list(Role)),
    draining=mostly_false,
    healthy=mostly_false.map(lambda sick: not sick),
    breaker=st.sampled_from(BREAKER_STATES),
    cooldown_s=st.floats(min_value=0.25, max_value=40.0),
    also_other=st.booleans(),
)


def make_breaker(state: str, cooldown_s: float) -> CircuitBreaker | None:
    if state == "disabled":
        return None
    breaker = CircuitBreaker(
        BreakerSettings(failure_threshold=1, cooldown_s=cooldown_s, max_cooldown_s=600.0)
    )
    if state == "closed":
        return breaker
    # "open" tripped just now; the half-open states tripped a cooldown and more ago.
    opened_at = NOW if state == "open" else NOW - cooldown_s - 1.0
    permit = breaker.acquire(opened_at)
    assert permit is not None
    breaker.record(permit, Outcome.FAULT, opened_at)
    if state == "probing":
        assert breaker.acquire(NOW) is not None
    return breaker


def build_fleet(model_specs: list[Spec], other_specs: list[Spec]) -> tuple[Fleet, Fleet]:
    """The fleet, and the same workers of "m" (sharing their breakers) with nothing else."""
    breakers = {}
    records: list[WorkerRecord] = []
    unhealthy: set[str] = set()
    for group, model, group_specs in (("m", "m", model_specs), ("o", "other", other_specs)):
        for index, spec in enumerate(group_specs):
            worker_id = f"{group}{index}"
            models = ("m", "other") if model == "m" and spec.also_other else (model,)
            records.append(
                WorkerRecord(
                    id=worker_id,
                    url=f"http://{worker_id}.test:8000",
                    models=models,
                    role=spec.role,
                    status=Status.DRAINING if spec.draining else Status.ACTIVE,
                )
            )
            breakers[worker_id] = make_breaker(spec.breaker, spec.cooldown_s)
            if not spec.healthy:
                unhealthy.add(worker_id)

    def fleet_of(chosen: list[WorkerRecord]) -> Fleet:
        fleet = Fleet(breaker_factory=breakers.__getitem__)
        fleet.replace_all(chosen)
        for worker in fleet.workers():
            worker.healthy = worker.id not in unhealthy
        return fleet

    return fleet_of(records), fleet_of([r for r in records if "m" in r.models])


def fit(worker: Worker) -> bool:
    """Not draining and healthy: may serve if its breaker lets it."""
    return not worker.draining and worker.healthy


def closed(worker: Worker) -> bool:
    return worker.breaker is None or worker.breaker.available(NOW)


@dataclass
class LegTruth:
    role: Role
    members: list[Worker]
    available: list[Worker]
    forceable: list[Worker]

    def ok(self, mode: AllOpenMode) -> bool:
        return bool(self.available) or (mode is AllOpenMode.DISPATCH and bool(self.forceable))

    def reasons(self) -> dict[str, int]:
        counts = {
            "draining": sum(1 for w in self.members if w.draining),
            "unhealthy": sum(1 for w in self.members if not w.draining and not w.healthy),
            "breaker open": len(self.forceable) if not self.available else 0,
        }
        return {reason: count for reason, count in counts.items() if count}


def truth(workers: list[Worker], role: Role) -> LegTruth:
    members = [w for w in workers if w.role is role]
    available = [w for w in members if fit(w) and closed(w)]
    forceable = [w for w in members if fit(w) and not closed(w)]
    return LegTruth(role, members, available, forceable)


def named(message: str, model: str, label: str) -> re.Match[str] | None:
    """The phrase that names the pool `label` as blocking, if the message has one."""
    noun = f"{label} " if label else ""
    pattern = (
        rf"(?:^|; )(?:{noun}pool for model '{model}' is (?P<empty>empty)"
        rf"|(?:all (?P<total>\d+) |the only ){noun}workers? for model '{model}'"
        rf" (?:is|are) unavailable \((?P<reasons>[^)]*)\))"
    )
    return re.search(pattern, message)


def outcome(result: Plan | Exception) -> object:
    if isinstance(result, Plan):
        return result.mode, {
            role: sorted(w.id for w in leg.candidates) for role, leg in result.legs.items()
        }
    assert isinstance(result, NoAvailableWorkers | ModelNotFound)
    return type(result), result.message, getattr(result, "retry_after_s", None)


def run(fleet: Fleet, mode: AllOpenMode, model: str = "m") -> Plan | Exception:
    try:
        return plan_request(model, fleet.for_model(model), NOW, mode)
    except (ModelNotFound, NoAvailableWorkers) as error:
        return error


@settings(max_examples=400, deadline=None)
@given(
    model_specs=st.lists(specs, max_size=7),
    other_specs=st.lists(specs, max_size=4),
    mode=st.sampled_from(list(AllOpenMode)),
    # "other" is served by the "o" workers and by the "m" workers that also serve it.
    requested=st.sampled_from(["m", "m", "other", "absent"]),
)
# A pair that would run on a breaker-open prefill, beside a closed mixed worker.
@example(
    model_specs=[
        Spec(Role.PREFILL, False, True, "open", 5.0, False),
        Spec(Role.DECODE, False, True, "closed", 5.0, False),
        Spec(Role.MIXED, False, True, "half_open", 5.0, True),
    ],
    other_specs=[],
    mode=AllOpenMode.DISPATCH,
    requested="m",
)
def test_verdicts_follow_each_legs_own_pool(
    model_specs: list[Spec], other_specs: list[Spec], mode: AllOpenMode, requested: str
) -> None:
    fleet, alone = build_fleet(model_specs, other_specs)
    # The oracle finds the model's workers itself, not through the index under test.
    workers = [w for w in fleet.workers() if requested in w.record.models]
    legs = {role: truth(workers, role) for role in Role}
    has_pd = bool(legs[Role.PREFILL].members or legs[Role.DECODE].members)
    has_mixed = bool(legs[Role.MIXED].members)
    pair_ok = has_pd and legs[Role.PREFILL].ok(mode) and legs[Role.DECODE].ok(mode)
    mixed_ok = legs[Role.MIXED].ok(mode)

    result = run(fleet, mode, requested)

    if requested == "m":
        # Other models never change the verdict for "m".
        assert outcome(result) == outcome(run(alone, mode))

    if not workers:
        assert isinstance(result, ModelNotFound)
        assert result.message == f"model '{requested}' is not served by any worker"
        return
    assert not isinstance(result, ModelNotFound)

    if isinstance(result, Plan):
        assert pair_ok or mixed_ok
        pair_forced = not (legs[Role.PREFILL].available and legs[Role.DECODE].available)
        expect_pd = pair_ok and not (pair_forced and legs[Role.MIXED].available)
        assert result.mode is (Mode.PD if expect_pd else Mode.MIXED)
        expected_roles = [Role.PREFILL, Role.DECODE] if expect_pd else [Role.MIXED]
        assert list(result.legs) == expected_roles
        for role, pool in result.legs.items():
            leg = legs[role]
            for worker in pool.candidates:
                assert worker.role is role
                assert fit(worker)
                assert pool.forced or closed(worker)
            want = leg.available or leg.forceable
            assert pool.forced is (not leg.available)
            assert {w.id for w in pool.candidates} == {w.id for w in want}
            assert pool.total == len(leg.members)
        return

    assert isinstance(result, NoAvailableWorkers)
    assert not (pair_ok or mixed_ok)
    assert result.retry_after_s >= 1.0
    message = result.message
    considered = {
        Role.PREFILL: has_pd,
        Role.DECODE: has_pd,
        Role.MIXED: has_mixed,
    }
    for role, leg in legs.items():
        label = role.value if role is not Role.MIXED or has_pd else ""
        match = named(message, requested, label)
        blocking = considered[role] and not leg.ok(mode)
        assert (match is not None) is blocking, (role, message)
        if match is None:
            continue
        if match["empty"]:
            assert not leg.members
            continue
        assert int(match["total"] or 1) == len(leg.members)
        reasons = {}
        for part in match["reasons"].split(", "):
            count, reason = part.split(" ", 1)
            reasons[reason] = int(count)
        assert reasons == leg.reasons()

"""404 versus 503, per leg: which pools serve a request, or exactly why none can."""

from __future__ import annotations

import pytest

from router.api.errors import ModelNotFound, NoAvailableWorkers
from router.fleet.breaker import BreakerSettings, CircuitBreaker, Outcome
from router.fleet.candidates import AllOpenMode
from router.fleet.records import Mode, Role, Status, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.pipeline.plan import Plan, plan_request

NOW = 100.0
DISPATCH = AllOpenMode.DISPATCH
REJECT = AllOpenMode.REJECT


def record(
    worker_id: str, role: Role = Role.MIXED, *, model: str = "m", draining: bool = False
) -> WorkerRecord:
    return WorkerRecord(
        id=worker_id,
        url=f"http://{worker_id}.test:8000",
        models=(model,),
        role=role,
        status=Status.DRAINING if draining else Status.ACTIVE,
    )


def fleet_of(*records: WorkerRecord, unhealthy: tuple[str, ...] = ()) -> Fleet:
    fleet = Fleet()
    fleet.replace_all(records)
    for worker_id in unhealthy:
        worker = fleet.get(worker_id)
        assert worker is not None
        worker.healthy = False
    return fleet


def trip(worker: Worker | None, cooldown_s: float) -> None:
    """Open `worker`'s breaker at NOW; it admits a probe `cooldown_s` later."""
    assert worker is not None
    breaker = CircuitBreaker(
        BreakerSettings(failure_threshold=1, cooldown_s=cooldown_s, max_cooldown_s=600.0)
    )
    permit = breaker.acquire(NOW)
    assert permit is not None
    breaker.record(permit, Outcome.FAULT, NOW)
    worker.breaker = breaker


def plan(fleet: Fleet, model: str = "m", all_open: AllOpenMode = DISPATCH) -> Plan:
    return plan_request(model, fleet.for_model(model), NOW, all_open)


def unavailable(
    fleet: Fleet, model: str = "m", all_open: AllOpenMode = DISPATCH
) -> NoAvailableWorkers:
    with pytest.raises(NoAvailableWorkers) as info:
        plan(fleet, model, all_open)
    return info.value


def ids(plan: Plan, role: Role) -> list[str]:
    return [worker.id for worker in plan.legs[role].candidates]


def test_a_model_nobody_serves_is_404_beside_a_healthy_fleet() -> None:
    fleet = fleet_of(record("a1", model="a"), record("a2", Role.PREFILL, model="a"))

    with pytest.raises(ModelNotFound) as info:
        plan(fleet, "b")

    assert info.value.status == 404
    assert info.value.code == "model_not_found"
    assert info.value.message == "model 'b' is not served by any worker"


def test_a_model_whose_workers_are_all_unhealthy_is_503() -> None:
    fleet = fleet_of(record("w1"), record("w2"), unhealthy=("w1", "w2"))

    error = unavailable(fleet)

    assert error.status == 503
    assert error.code == "no_available_workers"
    assert error.message == "all 2 workers for model 'm' are unavailable (2 unhealthy)"
    assert error.headers() == [(b"retry-after", b"1")]


def test_a_sole_draining_worker_is_named_singly() -> None:
    error = unavailable(fleet_of(record("w1", draining=True)))

    assert error.message == "the only worker for model 'm' is unavailable (1 draining)"


def test_an_empty_decode_pool_is_named_with_the_prefill_count() -> None:
    fleet = fleet_of(record("p1", Role.PREFILL), record("p2", Role.PREFILL))

    error = unavailable(fleet)

    assert error.message == "decode pool for model 'm' is empty; prefill has 2 workers"
    assert "prefill pool" not in error.message


def test_draining_and_unhealthy_decodes_are_counted() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL),
        record("d1", Role.DECODE, draining=True),
        record("d2", Role.DECODE, draining=True),
        record("d3", Role.DECODE),
        unhealthy=("d2", "d3"),
    )

    error = unavailable(fleet)

    # d2 is draining and unhealthy: it counts once, under draining.
    assert error.message == (
        "all 3 decode workers for model 'm' are unavailable (2 draining, 1 unhealthy);"
        " prefill has 1 worker"
    )


def test_both_pd_legs_blocked_are_both_named_and_nothing_else() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL, draining=True),
        record("d1", Role.DECODE),
        record("d2", Role.DECODE),
        unhealthy=("d1", "d2"),
    )

    error = unavailable(fleet)

    assert error.message == (
        "the only prefill worker for model 'm' is unavailable (1 draining);"
        " all 2 decode workers for model 'm' are unavailable (2 unhealthy)"
    )


def test_a_mixed_worker_beside_a_prefill_only_fleet_serves() -> None:
    fleet = fleet_of(record("p1", Role.PREFILL), record("p2", Role.PREFILL), record("x1"))

    result = plan(fleet)

    assert result.mode is Mode.MIXED
    assert list(result.legs) == [Role.MIXED]
    assert ids(result, Role.MIXED) == ["x1"]


def test_a_healthy_pd_pair_serves_and_is_preferred_to_mixed() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL),
        record("d1", Role.DECODE),
        record("d2", Role.DECODE),
        record("x1"),
    )

    result = plan(fleet)

    assert result.mode is Mode.PD
    assert list(result.legs) == [Role.PREFILL, Role.DECODE]
    assert (ids(result, Role.PREFILL), ids(result, Role.DECODE)) == (["p1"], ["d1", "d2"])


def test_a_broken_mixed_pool_does_not_block_a_healthy_pair() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL), record("d1", Role.DECODE), record("x1"), unhealthy=("x1",)
    )

    assert plan(fleet).mode is Mode.PD


def test_pair_and_mixed_both_blocked_name_every_blocking_pool() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL),
        record("x1", draining=True),
        record("x2", draining=True),
    )

    error = unavailable(fleet)

    assert error.message == (
        "decode pool for model 'm' is empty; prefill has 1 worker;"
        " all 2 mixed workers for model 'm' are unavailable (2 draining)"
    )


def test_a_second_healthy_model_does_not_change_the_verdict() -> None:
    alone = fleet_of(record("p1", Role.PREFILL), record("d1", Role.DECODE, draining=True))
    beside = fleet_of(
        record("p1", Role.PREFILL),
        record("d1", Role.DECODE, draining=True),
        record("n-p", Role.PREFILL, model="n"),
        record("n-d", Role.DECODE, model="n"),
        record("n-x", model="n"),
    )

    expected = (
        "the only decode worker for model 'm' is unavailable (1 draining); prefill has 1 worker"
    )
    assert unavailable(alone).message == expected
    assert unavailable(beside).message == expected
    assert plan(beside, "n").mode is Mode.PD


def test_all_open_reject_names_the_breaker_and_the_earliest_probe() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL), record("d1", Role.DECODE), record("d2", Role.DECODE)
    )
    trip(fleet.get("d1"), 7.0)
    trip(fleet.get("d2"), 2.5)

    error = unavailable(fleet, all_open=REJECT)

    assert error.message == (
        "all 2 decode workers for model 'm' are unavailable (2 breaker open); prefill has 1 worker"
    )
    assert error.retry_after_s == 3.0
    assert error.headers() == [(b"retry-after", b"3")]


def test_all_open_dispatch_forces_the_open_leg_only() -> None:
    fleet = fleet_of(
        record("p1", Role.PREFILL), record("d1", Role.DECODE), record("d2", Role.DECODE)
    )
    trip(fleet.get("d1"), 7.0)
    trip(fleet.get("d2"), 2.5)

    result = plan(fleet, all_open=DISPATCH)

    assert result.mode is Mode.PD
    assert (result.legs[Role.PREFILL].forced, result.legs[Role.DECODE].forced) == (False, True)
    assert ids(result, Role.DECODE) == ["d1", "d2"]


def test_a_forced_pair_gives_way_to_a_closed_mixed_worker() -> None:
    fleet = fleet_of(record("p1", Role.PREFILL), record("d1", Role.DECODE), record("x1"))
    trip(fleet.get("p1"), 5.0)

    result = plan(fleet, all_open=DISPATCH)

    assert result.mode is Mode.MIXED
    assert ids(result, Role.MIXED) == ["x1"]
    assert result.legs[Role.MIXED].forced is False


def test_retry_after_is_the_soonest_among_blocking_legs() -> None:
    fleet = fleet_of(record("p1", Role.PREFILL), record("d1", Role.DECODE), record("x1"))
    trip(fleet.get("p1"), 12.0)
    trip(fleet.get("x1"), 4.2)

    error = unavailable(fleet, all_open=REJECT)

    assert error.message == (
        "the only prefill worker for model 'm' is unavailable (1 breaker open);"
        " decode has 1 worker;"
        " the only mixed worker for model 'm' is unavailable (1 breaker open)"
    )
    assert error.retry_after_s == 5.0


def test_default_retry_after_applies_without_a_breaker_estimate() -> None:
    fleet = fleet_of(record("w1", draining=True))

    with pytest.raises(NoAvailableWorkers) as info:
        plan_request("m", fleet.for_model("m"), NOW, DISPATCH, default_retry_after_s=4.0)

    assert info.value.retry_after_s == 4.0
    assert info.value.headers() == [(b"retry-after", b"4")]

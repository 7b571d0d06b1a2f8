"""Waiting for a worker, under a mock clock: a slot on a capped worker, a worker coming
back, a model replaced, and who goes first."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from router.api.errors import ModelNotFound, NoAvailableWorkers, QueueTimeout
from router.fleet.candidates import AllOpenMode, filter_leg
from router.fleet.records import Role, Status, WorkerRecord
from router.fleet.registry import Fleet
from router.pipeline.plan import Plan, plan_request
from router.pipeline.wait import WorkerWait, WorkerWaitSettings

MODEL = "m"


def _record(worker_id: str, status: Status = Status.ACTIVE, model: str = MODEL) -> WorkerRecord:
    return WorkerRecord(id=worker_id, url=f"http://{worker_id}:1", models=(model,), status=status)


async def _plan(wait: WorkerWait, model: str) -> Plan:
    """`wait.plan` with the plain plan of the model's workers (no model memory)."""
    return await wait.plan(
        model,
        lambda now: plan_request(model, wait.fleet.for_model(model), now, AllOpenMode.DISPATCH),
    )


def _wait(fleet: Fleet, capacity_wait_s: float = 10.0, workers_wait_s: float = 0.0) -> WorkerWait:
    return WorkerWait(
        fleet, WorkerWaitSettings(capacity_wait_s=capacity_wait_s, workers_wait_s=workers_wait_s)
    )


def _worker_of(plan: Plan) -> list[str]:
    return [worker.id for worker in plan.legs[Role.MIXED].candidates]


def test_a_worker_at_its_cap_is_not_a_candidate() -> None:
    fleet = Fleet(max_inflight=2)
    busy, idle = fleet.upsert(_record("busy")), fleet.upsert(_record("idle"))
    busy.begin()
    busy.begin()
    pool = filter_leg(fleet.for_model(MODEL), Role.MIXED, 0.0, AllOpenMode.DISPATCH)
    assert [worker.id for worker in pool.candidates] == ["idle"]
    assert pool.full == 1
    idle.begin()
    assert not idle.full


def test_a_rank_multiplexed_worker_is_full_only_when_every_rank_is() -> None:
    fleet = Fleet(max_inflight=1)
    worker = fleet.upsert(dataclasses.replace(_record("dp"), dp_size=2))
    worker.begin(0)
    assert not worker.full
    worker.begin(1)
    assert worker.full


async def test_a_request_waits_for_a_slot_and_takes_it_when_one_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(max_inflight=1)
    worker = fleet.upsert(_record("only"))
    wait = _wait(fleet)
    worker.begin()
    got: list[tuple[list[str], float]] = []

    async def request() -> None:
        got.append((_worker_of(await _plan(wait, MODEL)), trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        await trio.sleep(2.5)
        assert wait.waiting() == 1
        worker.end()
        wait.notify(worker)
    assert got == [(["only"], 2.5)]
    assert wait.outcomes["served"] == 1


async def test_waiters_for_a_slot_go_in_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(max_inflight=1)
    worker = fleet.upsert(_record("only"))
    wait = _wait(fleet)
    worker.begin()
    order: list[int] = []

    async def request(number: int) -> None:
        await _plan(wait, MODEL)
        worker.begin()  # what dispatch does: the slot is taken
        order.append(number)

    async with trio.open_nursery() as nursery:
        for number in range(4):
            nursery.start_soon(request, number)
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(4):
            await trio.sleep(1.0)
            worker.end()
            wait.notify(worker)
    assert order == [0, 1, 2, 3]


async def test_no_slot_in_time_is_503_queue_timeout_at_exactly_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(max_inflight=1)
    fleet.upsert(_record("only")).begin()
    wait = _wait(fleet, capacity_wait_s=4.0)
    with pytest.raises(QueueTimeout) as caught:
        await _plan(wait, MODEL)
    assert caught.value.code == "queue_timeout"
    assert trio.current_time() == pytest.approx(4.0)
    assert wait.waiting() == 0 and wait.outcomes["timed_out"] == 1


async def test_without_a_wait_unavailable_workers_are_503_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet()
    fleet.upsert(_record("old", Status.DRAINING))
    with pytest.raises(NoAvailableWorkers):
        await _plan(_wait(fleet), MODEL)
    assert trio.current_time() == 0.0


async def test_a_drained_worker_replaced_3s_later_is_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet()
    fleet.upsert(_record("old", Status.DRAINING))
    wait = _wait(fleet, workers_wait_s=10.0)
    got: list[tuple[list[str], float]] = []

    async def request() -> None:
        got.append((_worker_of(await _plan(wait, MODEL)), trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        await trio.sleep(3.0)
        fleet.upsert(_record("new"))
    assert len(got) == 1 and got[0][0] == ["new"]
    # Noticed at the head's next re-plan, within one recheck interval.
    assert 3.0 <= got[0][1] <= 3.0 + wait.settings.recheck_s + 1e-9


async def test_a_model_whose_last_worker_left_is_waited_for_not_404(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet()
    fleet.upsert(_record("old"))
    wait = _wait(fleet, workers_wait_s=10.0)
    await _plan(wait, MODEL)  # the model is served: remembered
    await trio.sleep(100.0)
    fleet.remove("old")
    got: list[float] = []

    async def request() -> None:
        await _plan(wait, MODEL)
        got.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        await trio.sleep(3.0)
        fleet.upsert(_record("new"))
    assert got and got[0] - 100.0 == pytest.approx(3.0, abs=0.11)


async def test_a_model_nobody_served_is_404_at_once_and_a_gone_one_404_after_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet()
    fleet.upsert(_record("old"))
    wait = _wait(fleet, workers_wait_s=5.0)
    with pytest.raises(ModelNotFound):
        await _plan(wait, "never-served")
    assert trio.current_time() == 0.0
    await _plan(wait, MODEL)
    fleet.remove("old")
    with pytest.raises(ModelNotFound):
        await _plan(wait, MODEL)
    assert trio.current_time() == pytest.approx(5.0, abs=0.11)
    # Long gone: no wait any more.
    await trio.sleep(10.0)
    start = trio.current_time()
    with pytest.raises(ModelNotFound):
        await _plan(wait, MODEL)
    assert trio.current_time() == start


async def test_a_waiter_that_leaves_lets_the_next_one_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(max_inflight=1)
    worker = fleet.upsert(_record("only"))
    wait = _wait(fleet)
    worker.begin()
    served: list[str] = []
    leaver = trio.CancelScope()

    async def first() -> None:
        with leaver:
            await _plan(wait, MODEL)
            served.append("first")

    async def second() -> None:
        await _plan(wait, MODEL)
        served.append("second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        leaver.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert wait.waiting() == 1 and wait.outcomes["client_left"] == 1
        worker.end()
        wait.notify(worker)
    assert served == ["second"]
    assert wait.waiting() == 0


async def test_every_waiter_whose_wait_runs_out_gets_the_truthful_503_not_a_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet()
    fleet.upsert(_record("old", Status.DRAINING))
    wait = _wait(fleet, capacity_wait_s=60.0, workers_wait_s=5.0)
    outcomes: list[tuple[str, float]] = []

    async def request() -> None:
        try:
            await _plan(wait, MODEL)
        except NoAvailableWorkers as error:
            outcomes.append((error.code, trio.current_time()))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(request)
    assert [code for code, _ in outcomes] == ["no_available_workers"] * 3
    assert all(at == pytest.approx(5.0, abs=0.11) for _, at in outcomes)
    assert wait.waiting() == 0 and wait.outcomes["timed_out"] == 3

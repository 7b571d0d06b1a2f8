"""The admission gate under a mock clock: the limit, FIFO order, the bounded line, the
queue timeout at its exact virtual time, a waiter that leaves, and the traffic policy
(classes served highest first, tenants in turn, tenant caps named in the refusals)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from router.api.errors import QueueFull, QueueTimeout
from router.edge.admission import AdmissionGate, AdmissionSettings
from router.edge.claims import Claims, PriorityClasses
from router.edge.fair_queue import TenantLimits
from router.observability.metrics import AdmissionMetrics


def _gate(
    limit: int = 2,
    queue_size: int = 2,
    timeout_s: float = 10.0,
    classes: PriorityClasses | None = None,
    metrics: AdmissionMetrics | None = None,
) -> AdmissionGate:
    return AdmissionGate(
        AdmissionSettings(
            limit=limit,
            queue_size=queue_size,
            timeout_s=timeout_s,
            classes=classes or PriorityClasses(),
        ),
        metrics,
    )


def _claims(key: str, rank: int = 0, limits: TenantLimits | None = None) -> Claims:
    return Claims(rank, (key, ""), limits or TenantLimits(), key)


async def test_no_limit_admits_everyone_at_once() -> None:
    gate = _gate(limit=0, queue_size=0)
    assert not gate.enabled
    entered = 0
    async with trio.open_nursery() as nursery:
        release = trio.Event()

        async def hold() -> None:
            nonlocal entered
            async with gate.admit():
                entered += 1
                await release.wait()

        for _ in range(50):
            nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        assert entered == 50
        assert gate.statistics().waiting == 0
        release.set()
    assert gate.statistics().active == 0


async def test_waiters_start_in_arrival_order_and_the_full_line_refuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=2, queue_size=2)
    started: list[int] = []
    refused: list[int] = []

    async def request(number: int, work_s: float) -> None:
        try:
            async with gate.admit():
                started.append(number)
                await trio.sleep(work_s)
        except QueueFull as error:
            assert error.status == 429
            assert (b"retry-after", b"1") in error.headers()
            refused.append(number)

    async with trio.open_nursery() as nursery:
        for number in range(6):
            nursery.start_soon(request, number, 5.0 + number if number < 2 else 1.0)
            await trio.testing.wait_all_tasks_blocked()
        stats = gate.statistics()
        assert (stats.active, stats.waiting) == (2, 2)
    assert started == [0, 1, 2, 3]
    assert refused == [4, 5]
    stats = gate.statistics()
    assert (stats.active, stats.waiting, stats.queue_full) == (0, 0, 2)


async def test_a_waiter_gives_up_at_exactly_the_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=1, queue_size=4, timeout_s=3.0)
    outcome: list[tuple[str, float]] = []

    async def holder() -> None:
        async with gate.admit():
            await trio.sleep(10.0)

    async def waiter() -> None:
        start = trio.current_time()
        try:
            async with gate.admit():
                outcome.append(("admitted", trio.current_time() - start))
        except QueueTimeout as error:
            assert (error.status, error.code) == (503, "queue_timeout")
            assert (b"retry-after", b"1") in error.headers()
            outcome.append(("timeout", trio.current_time() - start))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter)
    assert outcome == [("timeout", 3.0)]
    stats = gate.statistics()
    assert (stats.active, stats.waiting, stats.queue_timeout) == (0, 0, 1)


async def test_a_cancelled_waiter_leaves_the_line_and_the_next_one_starts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=1, queue_size=2, timeout_s=100.0)
    started: list[str] = []
    release = trio.Event()

    async def request(name: str) -> None:
        async with gate.admit():
            started.append(name)
            if name == "holder":
                await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "holder")
        await trio.testing.wait_all_tasks_blocked()
        leaver_scope = trio.CancelScope()

        async def leaver() -> None:
            with leaver_scope:
                await request("leaver")

        nursery.start_soon(leaver)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "next")
        await trio.testing.wait_all_tasks_blocked()
        assert gate.statistics().waiting == 2
        leaver_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        # The line is shorter at once, not when the holder finishes.
        assert gate.statistics().waiting == 1
        assert gate.statistics().left_queue == 1
        release.set()
    assert started == ["holder", "next"]
    assert gate.statistics().active == 0


async def test_a_slot_handed_to_a_waiter_cancelled_in_the_same_instant_passes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=1, queue_size=2, timeout_s=100.0)
    started: list[str] = []
    release = trio.Event()
    first_scope = trio.CancelScope()

    async def holder() -> None:
        async with gate.admit():
            await release.wait()
            # Free the slot and cancel its heir before the heir can run.
            first_scope.cancel()

    async def first() -> None:
        with first_scope:
            async with gate.admit():
                started.append("first")

    async def second() -> None:
        async with gate.admit():
            started.append("second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert started == ["second"]
    stats = gate.statistics()
    assert (stats.active, stats.waiting) == (0, 0)


async def test_a_zero_queue_refuses_at_once_beyond_the_limit() -> None:
    gate = _gate(limit=1, queue_size=0)
    async with gate.admit():
        with pytest.raises(QueueFull):
            async with gate.admit():
                pass  # pragma: no cover - refused before the body runs
    assert gate.statistics().active == 0


async def test_a_higher_class_that_arrives_last_is_served_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    classes = PriorityClasses(("high", "low"), "low")
    metrics = AdmissionMetrics()
    gate = _gate(limit=1, queue_size=10, classes=classes, metrics=metrics)
    started: list[str] = []

    async def request(name: str, rank: int) -> None:
        async with gate.admit(_claims(name[0], rank)):
            started.append(name)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for name in ("l0", "l1", "l2"):
            nursery.start_soon(request, name, 1)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "h0", 0)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.statistics().waiting_by_class == (1, 2)
    assert started == ["l0", "h0", "l1", "l2"]
    # h0 waited for l0's second, l2 for three: the waits are observed by class.
    sums = {
        sample.labels["class"]: sample.value
        for family in metrics.wait.collect()
        for sample in family.samples
        if sample.name.endswith("_sum")
    }
    assert sums == {"high": 1.0, "low": 0.0 + 2.0 + 3.0}


async def test_a_flooding_tenant_does_not_hold_up_a_light_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=2, queue_size=100, timeout_s=100.0)
    light_waits: list[float] = []

    async def request(key: str) -> None:
        arrived = trio.current_time()
        async with gate.admit(_claims(key)):
            if key == "light":
                light_waits.append(trio.current_time() - arrived)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for _ in range(40):
            nursery.start_soon(request, "flood")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "light")
    # Behind 38 of the flood's requests in one FIFO line it would wait 19 s; its turn
    # comes with the next slot that frees.
    assert light_waits == [1.0]


async def test_tenant_limits_are_named_in_the_refusals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=4, queue_size=10, timeout_s=3.0)
    capped = _claims("batch", limits=TenantLimits(max_inflight=1, max_queued=1))
    errors: list[QueueFull | QueueTimeout] = []

    async def request() -> None:
        try:
            async with gate.admit(capped):
                await trio.sleep(10.0)
        except (QueueFull, QueueTimeout) as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(request)
            await trio.testing.wait_all_tasks_blocked()
        # One in flight, one waiting behind the tenant's own cap, one refused.
        stats = gate.statistics()
        assert (stats.active, stats.waiting, stats.tenant_queue_full) == (1, 1, 1)
        # Slots are free for everyone else.
        async with gate.admit(_claims("other")):
            pass
    full, timed_out = errors
    assert isinstance(full, QueueFull) and full.limit == "tenant_queue"
    assert (full.status, full.code) == (429, "queue_full")
    assert "key 'batch' already has 1 requests waiting (its max_queued)" in full.message
    assert isinstance(timed_out, QueueTimeout) and timed_out.limit == "tenant_inflight"
    assert (timed_out.status, timed_out.code) == (503, "queue_timeout")
    assert "key 'batch''s own 1 requests in flight (its max_inflight)" in timed_out.message
    stats = gate.statistics()
    assert (stats.active, stats.waiting, stats.tenant_inflight_timeout) == (0, 0, 1)


async def test_a_thousand_queued_clients_that_leave_are_never_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = _gate(limit=2, queue_size=1000, timeout_s=100.0)
    admitted = 0
    release = trio.Event()

    async def holder() -> None:
        async with gate.admit(_claims("holder")):
            await release.wait()

    async def waiter(key: str) -> None:
        nonlocal admitted
        async with gate.admit(_claims(key)):
            admitted += 1

    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        leavers = trio.CancelScope()

        async def leave_later() -> None:
            with leavers:
                async with trio.open_nursery() as crowd:
                    for number in range(1000):
                        crowd.start_soon(waiter, f"t{number % 7}")

        nursery.start_soon(leave_later)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.statistics().waiting == 1000
        leavers.cancel()
        await trio.testing.wait_all_tasks_blocked()
        stats = gate.statistics()
        assert (stats.active, stats.waiting, stats.left_queue) == (2, 0, 1000)
        release.set()
    assert admitted == 0
    stats = gate.statistics()
    assert (stats.active, stats.waiting) == (0, 0)

"""The admission gate under a mock clock: the limit, FIFO order, the bounded line, the
queue timeout at its exact virtual time, and a waiter that leaves."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from router.api.errors import QueueFull, QueueTimeout
from router.edge.admission import AdmissionGate, AdmissionSettings


def _gate(limit: int = 2, queue_size: int = 2, timeout_s: float = 10.0) -> AdmissionGate:
    return AdmissionGate(AdmissionSettings(limit=limit, queue_size=queue_size, timeout_s=timeout_s))


async def test_no_limit_admits_everyone_and_counts_nothing() -> None:
    gate = _gate(limit=0, queue_size=0)
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
        assert gate.statistics().active == 0
        release.set()


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

"""ConnectionSlots: a cap on one worker's connections, and a fair line beyond it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from router.http.upstream.connection_slots import ConnectionSlots, SlotWaitTimeout


def never(item: str) -> None:
    raise AssertionError(f"nothing should be discarded, got {item!r}")


async def test_the_cap_is_counted_and_freed() -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take()
    slots.release()
    assert slots.open == 1 and slots.try_take()


async def test_waiters_are_served_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(1)
    assert slots.try_take()
    got: dict[int, str | None] = {}

    async def wait(index: int) -> None:
        got[index] = await slots.wait(60, never)

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(wait, index)
            await trio.testing.wait_all_tasks_blocked()
        assert slots.waiting == 3
        # A newcomer does not jump the line, even with a slot about to free.
        assert not slots.try_take()
        assert slots.offer("conn-a")  # a reusable connection, handed over as it is
        slots.release()  # a closed one: its slot passes on
        slots.release()
    assert got == {0: "conn-a", 1: None, 2: None}
    assert slots.open == 1 and slots.waiting == 0
    assert not slots.offer("conn-b")  # nobody waits: the caller pools it


async def test_a_wait_ends_at_its_timeout_exactly(autojump_clock: trio.testing.MockClock) -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(1)
    assert slots.try_take()
    started = trio.current_time()
    with pytest.raises(SlotWaitTimeout):
        await slots.wait(2.5, never)
    assert trio.current_time() - started == 2.5
    assert slots.waiting == 0 and slots.open == 1


async def test_what_is_handed_to_a_cancelled_waiter_is_given_up_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(1)
    assert slots.try_take()
    discarded: list[str] = []
    returned: list[str | None] = []

    async def wait_in_scope(scope: trio.CancelScope) -> None:
        with scope:
            returned.append(await slots.wait(60, discarded.append))

    # Cancelled, then handed a connection before it ran again: it gives the connection up.
    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_in_scope, scope)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        assert slots.offer("conn-a")
    assert (discarded, returned) == (["conn-a"], [])

    # The same with a slot: it goes back to the free count.
    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_in_scope, scope)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        slots.release()
    assert slots.open == 0 and slots.waiting == 0 and returned == []

    # Handed over first, cancelled after: the waiter has it (its caller closes it).
    assert slots.try_take()
    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_in_scope, scope)
        await trio.testing.wait_all_tasks_blocked()
        assert slots.offer("conn-b")
        scope.cancel()
    assert (discarded, returned) == (["conn-a"], ["conn-b"])

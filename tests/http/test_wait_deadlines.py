"""One timer for every connection's wait: each wait ends exactly at its deadline, an
earlier deadline wakes the timer, a wait that ended is never expired, and the entries stay
bounded by the waits pending, not by the waits made."""

from __future__ import annotations

import math

import trio
import trio.testing

from router.http.wait_deadlines import WaitDeadlines


class FakeWaiter:
    """A reader's wait as the timer sees it; `expired` records when it was ended."""

    def __init__(self) -> None:
        self.wait_deadline = math.inf
        self.wait_number = 0
        self.expired: list[float] = []

    def begin(self, deadlines: WaitDeadlines, deadline: float) -> None:
        self.wait_number += 1
        self.wait_deadline = deadline
        deadlines.waiting(self)

    def end(self, deadlines: WaitDeadlines) -> None:
        self.wait_deadline = math.inf
        deadlines.done(self)

    def expire(self) -> None:
        self.expired.append(trio.current_time())
        self.wait_deadline = math.inf


async def test_each_wait_ends_exactly_at_its_deadline_an_earlier_one_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadlines = WaitDeadlines()
    late, early = FakeWaiter(), FakeWaiter()
    async with trio.open_nursery() as nursery:
        await nursery.start(deadlines.serve)
        start = trio.current_time()
        late.begin(deadlines, start + 75.0)
        await trio.sleep(1.0)
        # Registered while the timer sleeps until the later one: it must wake for this.
        early.begin(deadlines, start + 11.0)
        await trio.sleep(100.0)
        nursery.cancel_scope.cancel()
    assert early.expired == [start + 11.0]
    assert late.expired == [start + 75.0]


async def test_a_wait_that_ended_is_never_expired_and_its_next_wait_counts_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadlines = WaitDeadlines()
    waiter = FakeWaiter()
    async with trio.open_nursery() as nursery:
        await nursery.start(deadlines.serve)
        start = trio.current_time()
        waiter.begin(deadlines, start + 10.0)
        await trio.sleep(5.0)
        waiter.end(deadlines)  # bytes came
        waiter.begin(deadlines, start + 20.0)  # the next request's wait
        await trio.sleep(30.0)
        nursery.cancel_scope.cancel()
    assert waiter.expired == [start + 20.0]


async def test_entries_stay_bounded_by_the_waits_pending() -> None:
    deadlines = WaitDeadlines()
    idle = [FakeWaiter() for _ in range(10)]
    for waiter in idle:
        waiter.begin(deadlines, 1000.0)  # pending throughout
    busy = FakeWaiter()
    for number in range(10_000):
        busy.begin(deadlines, 500.0 + number)
        busy.end(deadlines)
        assert deadlines.pending <= 2 * 11 + 64
    assert all(waiter.expired == [] for waiter in idle)


def test_a_wait_without_a_deadline_takes_no_entry() -> None:
    deadlines = WaitDeadlines()
    FakeWaiter().begin(deadlines, math.inf)
    assert deadlines.pending == 0

"""One timer for every connection's wait for a client's bytes.

A connection waits for its client between requests (the keep-alive idle timeout, then the
header timeout once a first byte came), and for a body that did not come with its head (the
body timeout). Each wait in a trio cancel scope of its own cost about a twentieth of a
proxied request's instructions (docs/performance.md, "The lean path (issue 43), second
round"). The wait is the connection's own (`ConnectionReader.receive`, a task parked until
its reader task brings bytes), so a deadline needs no scope: each wait registers its
deadline here, and one task per server wakes at the earliest one and tells every reader
whose deadline passed that it did (`ConnectionReader.expire`).

Registrations are kept in a heap; a wait that ends before its deadline leaves its entry to
be dropped when it reaches the top, and the heap is rebuilt from the waits still pending
whenever it holds more than twice as many entries (plus a constant), so its size stays
bounded by the connections, not by the requests. Clock: trio's (`MockClock` drives it).
"""

from __future__ import annotations

import heapq
import math
from typing import Protocol

import trio

__all__ = ["ReadDeadlines"]

_SLACK_ENTRIES = 64


class Waiter(Protocol):
    """A connection's reader as the timer sees it."""

    @property
    def wait_deadline(self) -> float:
        """When the pending wait times out; `math.inf` while none is pending."""
        ...

    @property
    def wait_number(self) -> int:
        """Which wait is pending (each wait takes the next number)."""
        ...

    def expire(self) -> None:
        """The pending wait's deadline passed: end it."""
        ...


class ReadDeadlines:
    """The deadlines of every pending wait of one server's connections."""

    __slots__ = ("_entries", "_live", "_serial", "_sleep")

    def __init__(self) -> None:
        # (deadline, serial, waiter, its wait number): the serial keeps ties off the waiters.
        self._entries: list[tuple[float, int, Waiter, int]] = []
        self._serial = 0
        self._live: set[Waiter] = set()
        """Waiters with a wait pending now (what a rebuild keeps)."""
        self._sleep: trio.CancelScope | None = None

    def waiting(self, waiter: Waiter) -> None:
        """`waiter` began a wait until its `wait_deadline`."""
        deadline = waiter.wait_deadline
        if deadline == math.inf:
            return
        self._live.add(waiter)
        entries = self._entries
        self._serial += 1
        heapq.heappush(entries, (deadline, self._serial, waiter, waiter.wait_number))
        if len(entries) > 2 * len(self._live) + _SLACK_ENTRIES:
            self._rebuild()
        sleep = self._sleep
        if sleep is not None and deadline < sleep.deadline:
            sleep.deadline = deadline

    def done(self, waiter: Waiter) -> None:
        """`waiter`'s wait ended (bytes came, or it was cancelled, or it expired)."""
        self._live.discard(waiter)

    @property
    def pending(self) -> int:
        """Entries held (for tests: the bound holds)."""
        return len(self._entries)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expire every wait at its deadline, for as long as this runs (the server's life).

        Cancellation: stops at once; pending waits keep waiting, without a deadline.
        """
        task_status.started()
        try:
            while True:
                with trio.CancelScope(deadline=self._expire_due(trio.current_time())) as sleep:
                    self._sleep = sleep
                    await trio.sleep_forever()
        finally:
            self._sleep = None

    def _expire_due(self, now: float) -> float:
        """Expire the waits due at `now`; the next deadline (`math.inf`: none)."""
        entries = self._entries
        while entries:
            deadline, _, waiter, number = entries[0]
            current = waiter.wait_number == number and waiter.wait_deadline == deadline
            if current and deadline > now:
                return deadline
            heapq.heappop(entries)
            if current:
                self._live.discard(waiter)
                waiter.expire()
        return math.inf

    def _rebuild(self) -> None:
        """Keep one entry per pending wait (the stale ones are waits that ended)."""
        entries = [
            (waiter.wait_deadline, serial, waiter, waiter.wait_number)
            for serial, waiter in enumerate(self._live)
            if waiter.wait_deadline != math.inf
        ]
        heapq.heapify(entries)
        self._entries = entries
        self._serial = len(entries)

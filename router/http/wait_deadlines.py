"""One timer for many waits on sockets: each wait registers its deadline, one task ends
the waits whose deadline passed.

A trio cancel scope per wait cost about a sixteenth of a proxied request's instructions
(docs/performance.md, "The lean path (issue 43), second round"), and a request waited in
two: for its client's next bytes (the keep-alive idle, header and body time-outs), and for
its worker's response head (the first-byte deadline). Neither wait needs a scope: the
client's is the connection's own parked task (`ConnectionReader`, which `expire` wakes
with a time-out), and a worker's is given up with its connection (`UpstreamConnection`,
which `expire` closes, waking whatever waits on its socket). The server runs one timer for
its connections, the upstream pool one for its own.

Registrations are kept in a heap; a wait that ends before its deadline leaves its entry to
be dropped when it reaches the top, and the heap is rebuilt from the waits still pending
whenever it holds more than twice as many entries (plus a constant), so its size stays
bounded by the connections, not by the requests. Clock: trio's (`MockClock` drives it).
"""

from __future__ import annotations

import heapq
import math
from typing import Final, Protocol

import trio

__all__ = ["WaitDeadlines", "Waiter"]

_SLACK_ENTRIES: Final = 64


class Waiter(Protocol):
    """A wait as the timer sees it."""

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


class WaitDeadlines:
    """The deadlines of every pending wait of one owner (a server, a pool)."""

    __slots__ = ("_entries", "_live", "_serial", "_serving", "_sleep")

    def __init__(self) -> None:
        # (deadline, serial, waiter, its wait number): the serial keeps ties off the waiters.
        self._entries: list[tuple[float, int, Waiter, int]] = []
        self._serial = 0
        self._live: set[Waiter] = set()
        """Waiters with a wait pending now (what a rebuild keeps)."""
        self._sleep: trio.CancelScope | None = None
        self._serving = False

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
    def serving(self) -> bool:
        """Whether `serve` runs: only then does a deadline end a wait."""
        return self._serving

    @property
    def pending(self) -> int:
        """Entries held (for tests: the bound holds)."""
        return len(self._entries)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expire every wait at its deadline, for as long as this runs (its owner's life).

        Cancellation: stops at once; pending waits keep waiting, without a deadline.
        """
        self._serving = True
        task_status.started()
        try:
            while True:
                with trio.CancelScope(deadline=self._expire_due(trio.current_time())) as sleep:
                    self._sleep = sleep
                    await trio.sleep_forever()
        finally:
            self._serving = False
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

"""One worker's connections counted against a cap, with a FIFO queue of checkouts beyond it.

A slot is one open connection (being connected, in use or idle). A checkout that finds
no idle connection and no free slot waits in line; whoever frees something hands it to
the first in line: a connection that came back reusable is handed over as it is, a
closed one passes on its slot (the waiter connects anew). Nothing is ever handed to a
newcomer while someone waits, so the order is first come, first served.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

__all__ = ["ConnectionSlots", "SlotWaitTimeout"]

T = TypeVar("T")


class SlotWaitTimeout(Exception):
    """No connection or slot was freed within the caller's wait."""


class _Waiter(Generic[T]):
    __slots__ = ("event", "granted", "item")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False
        self.item: T | None = None


class ConnectionSlots(Generic[T]):
    """Counts open connections of one worker; `T` is the connection type handed over."""

    __slots__ = ("_waiters", "cap", "open")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0
        self._waiters: deque[_Waiter[T]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_take(self) -> bool:
        """Takes a free slot for a new connection, unless the cap is reached or others wait."""
        if self._waiters or self.open >= self.cap:
            return False
        self.open += 1
        return True

    def offer(self, connection: T) -> bool:
        """Hands a reusable connection (its slot with it) to the first waiter, if any."""
        if not self._waiters:
            return False
        self._grant(self._waiters.popleft(), connection)
        return True

    def release(self) -> None:
        """A connection closed (or a connect failed): its slot goes to the first waiter,
        or back to the free count."""
        if self._waiters:
            self._grant(self._waiters.popleft(), None)
        else:
            self.open -= 1

    async def wait(self, timeout_s: float, discard: Callable[[T], None]) -> T | None:
        """Waits in line for a handed-over connection (returned) or a slot (None: connect).

        Raises SlotWaitTimeout after `timeout_s`. Cancellation: the waiter leaves the line;
        anything handed to it meanwhile is given up again (`discard` closes a connection,
        which frees its slot for the next in line).
        """
        waiter: _Waiter[T] = _Waiter()
        self._waiters.append(waiter)
        try:
            with trio.move_on_after(timeout_s):
                await waiter.event.wait()
        except BaseException:
            self._abandon(waiter, discard)
            raise
        if not waiter.granted:
            self._waiters.remove(waiter)
            raise SlotWaitTimeout(f"no connection freed within {timeout_s:g}s")
        return waiter.item

    def _abandon(self, waiter: _Waiter[T], discard: Callable[[T], None]) -> None:
        if not waiter.granted:
            self._waiters.remove(waiter)
        elif waiter.item is not None:
            discard(waiter.item)
        else:
            self.release()

    @staticmethod
    def _grant(waiter: _Waiter[T], item: T | None) -> None:
        waiter.granted = True
        waiter.item = item
        waiter.event.set()

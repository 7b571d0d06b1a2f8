"""The run's clock, read the short way on the request path.

`trio.current_time()` reaches the clock through three Python calls and a thread-local
lookup; a request reads it a dozen times (deadlines, durations, the breaker's verdict).
`keep_clock()`, called once by the server as it starts serving, stores the clock's own
reader in a context variable, which every task the server starts from then on inherits:
there, `now()` is one context-variable read and one call. Elsewhere (a task started
before, or code run outside the server) `now()` is `trio.current_time()`. Either way it
reads the run's own clock, so a test's `MockClock` holds (docs/performance.md, "fifth
round").
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Final

import trio

__all__ = ["keep_clock", "now", "reader"]

_READER: Final[contextvars.ContextVar[Callable[[], float] | None]] = contextvars.ContextVar(
    "router_clock_reader", default=None
)


def keep_clock() -> None:
    """From here on, this task and the tasks it starts read the run's clock directly."""
    _READER.set(trio.lowlevel.current_clock().current_time)


def now() -> float:
    """The run's current time, as `trio.current_time()` gives it."""
    read = _READER.get()
    return trio.current_time() if read is None else read()


def reader() -> Callable[[], float]:
    """The run's clock's own reader, for a loop that reads it many times (a relayed
    stream, once per event): one call per reading, not even `now()`'s variable read."""
    read = _READER.get()
    return trio.lowlevel.current_clock().current_time if read is None else read

"""Admission: a global cap on requests served at once, with a bounded FIFO queue before it.

Beyond `limit` requests in service, a request waits in line; beyond `queue_size` waiting,
it is refused at once (429); after `timeout_s` in line it gives up (503 `queue_timeout`).
A slot freed by a finishing request goes straight to the oldest waiter, so a newcomer can
never overtake the line. A waiter that is cancelled (its client left) leaves the line at
once, and a slot it was handed in the same instant passes on to the next one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.api.errors import QueueFull, QueueTimeout


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    limit: int
    """Requests served at once; 0 means no limit (and no queue)."""
    queue_size: int
    timeout_s: float
    retry_after_s: float = 1.0


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    active: int
    waiting: int
    limit: int
    queue_size: int
    queue_full: int
    """Requests refused because the line was full (429), since start."""
    queue_timeout: int
    """Requests that waited out the queue timeout (503), since start."""
    left_queue: int
    """Requests cancelled while waiting (their client left), since start."""


class _Waiter:
    __slots__ = ("admitted", "event")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.admitted = False


class AdmissionGate:
    """The global concurrency limit and its FIFO queue. Unbounded when `limit` is 0."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self._active = 0
        # Insertion-ordered: the first key is the oldest waiter; leaving is O(1).
        self._line: dict[_Waiter, None] = {}
        self._queue_full = self._queue_timeout = self._left_queue = 0

    @property
    def enabled(self) -> bool:
        return self.settings.limit > 0

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            self._active,
            len(self._line),
            self.settings.limit,
            self.settings.queue_size,
            self._queue_full,
            self._queue_timeout,
            self._left_queue,
        )

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one slot for the body of the `async with`.

        Raises QueueFull when the line is full and QueueTimeout when the wait runs out.
        Cancellation while waiting: the request leaves the line (a slot handed to it in
        the meantime goes to the next waiter); while holding: the slot is released.
        """
        if not self.enabled:
            yield
            return
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        settings = self.settings
        if self._active < settings.limit and not self._line:
            self._active += 1
            return
        if len(self._line) >= settings.queue_size:
            self._queue_full += 1
            raise QueueFull(
                f"the router is serving {self._active} requests and {len(self._line)} are waiting "
                f"(limits {settings.limit} and {settings.queue_size}): try again later",
                settings.retry_after_s,
            )
        waiter = _Waiter()
        self._line[waiter] = None
        try:
            with trio.move_on_after(settings.timeout_s):
                await waiter.event.wait()
        except BaseException:
            # Cancelled (the client left, shutdown): leave the line, or pass on a slot
            # handed over in the same instant.
            if waiter.admitted:
                self._release()
            else:
                del self._line[waiter]
                self._left_queue += 1
            raise
        if not waiter.admitted:
            del self._line[waiter]
            self._queue_timeout += 1
            raise QueueTimeout(
                f"waited {settings.timeout_s:g}s in the admission queue without a free slot",
                settings.retry_after_s,
            )

    def _release(self) -> None:
        """Hand the slot to the oldest waiter, or give it back."""
        if self._line:
            waiter = next(iter(self._line))
            del self._line[waiter]
            waiter.admitted = True
            waiter.event.set()
            return
        self._active -= 1


class AdmissionCollector(Collector):
    """The gate's gauges and counters, read at scrape time (the request path keeps plain ints)."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._gate.statistics()
        yield GaugeMetricFamily(
            "router_admission_active",
            "Generation requests holding an admission slot (0 when there is no limit)",
            value=stats.active,
        )
        yield GaugeMetricFamily(
            "router_admission_queue_depth",
            "Requests waiting in the admission queue for a slot",
            value=stats.waiting,
        )
        refused = CounterMetricFamily(
            "router_admission_refused",
            "Requests that got no admission slot, by reason",
            labels=["reason"],
        )
        refused.add_metric(["queue_full"], stats.queue_full)
        refused.add_metric(["queue_timeout"], stats.queue_timeout)
        refused.add_metric(["client_left"], stats.left_queue)
        yield refused

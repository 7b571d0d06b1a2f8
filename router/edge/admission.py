"""Admission: a cap on requests served at once, and the line before it, in priority
classes with fair shares per tenant.

Beyond `limit` requests in service, a request waits in line; beyond `queue_size` waiting
(or its tenant's `max_queued`), it is refused at once (429); after `timeout_s` in line it
gives up (503 `queue_timeout`). Who goes next is `router.edge.fair_queue`'s decision:
higher classes first, tenants in turn within a class, a tenant at its in-flight cap
skipped until one of its requests ends. With one class and one tenant that is the FIFO
line it always was: a freed slot goes straight to the oldest waiter, and a newcomer never
overtakes the line.

A waiter that is cancelled (its client left: the server cancels the handler the moment it
reads end-of-stream) leaves the line at once, is counted, and is never dispatched; a slot
handed to it in the same instant passes on to the next one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.api.errors import QueueFull, QueueTimeout
from router.edge.claims import DEFAULT_CLAIMS, Claims, PriorityClasses
from router.edge.fair_queue import Arrival, Blocker, FairQueue
from router.http import clock
from router.observability.metrics import AdmissionMetrics


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    limit: int
    """Requests served at once; 0 means no limit (requests wait only for tenant caps)."""
    queue_size: int
    timeout_s: float
    retry_after_s: float = 1.0
    classes: PriorityClasses = field(default_factory=PriorityClasses)


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
    tenant_queue_full: int = 0
    """Requests refused because their tenant's share of the line was full (429)."""
    tenant_inflight_timeout: int = 0
    """Requests that waited out the timeout behind their tenant's own in-flight cap (503)."""
    waiting_by_class: tuple[int, ...] = ()


class _Waiter:
    __slots__ = ("admitted", "event")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.admitted = False


class AdmissionGate:
    """The concurrency limit and its line.

    `enabled` says whether there is a limit; without one the gate is needed only for
    tenant caps (the caller knows from the keys), and a router with neither skips it and
    pays nothing for it.
    """

    def __init__(
        self, settings: AdmissionSettings, metrics: AdmissionMetrics | None = None
    ) -> None:
        self.settings = settings
        self.classes = settings.classes
        self._queue: FairQueue[_Waiter] = FairQueue(
            settings.classes.count,
            settings.limit,
            settings.queue_size,
            settings.classes.lowest_share,
        )
        self._metrics = metrics if metrics is not None else AdmissionMetrics()
        self._queue_full = self._queue_timeout = self._left_queue = 0
        self._tenant_queue_full = self._tenant_inflight_timeout = 0
        self.enabled = settings.limit > 0

    def statistics(self) -> AdmissionStatistics:
        queue = self._queue.statistics()
        return AdmissionStatistics(
            queue.active,
            queue.waiting,
            self.settings.limit,
            self.settings.queue_size,
            self._queue_full,
            self._queue_timeout,
            self._left_queue,
            self._tenant_queue_full,
            self._tenant_inflight_timeout,
            queue.waiting_by_class,
        )

    def tenant_waiting(self) -> dict[str, int]:
        """Requests waiting per key name (the tenants of a key's header summed under it)."""
        waiting: dict[str, int] = {}
        for (key, _), (_, queued) in self._queue.tenant_counts().items():
            if queued:
                waiting[key] = waiting.get(key, 0) + queued
        return waiting

    @asynccontextmanager
    async def admit(self, claims: Claims = DEFAULT_CLAIMS) -> AsyncIterator[None]:
        """Hold one slot for the body of the `async with`.

        Raises QueueFull when the line (or the tenant's share of it) is full and
        QueueTimeout when the wait runs out; each names the limit in the way.
        Cancellation while waiting: the request leaves the line (a slot handed to it in
        the meantime goes to the next waiter); while holding: the slot is released.
        """
        await self._acquire(claims)
        try:
            yield
        finally:
            self._release(claims)

    async def _acquire(self, claims: Claims) -> None:
        settings = self.settings
        waiter = _Waiter()
        arrival = self._queue.arrive(waiter, claims.rank, claims.tenant, claims.limits)
        if arrival is Arrival.ADMITTED:
            self._metrics.observe_wait(self.classes.name_of(claims.rank), claims.key, 0.0)
            return
        if arrival is not Arrival.QUEUED:
            raise self._refusal(arrival, claims)
        arrived = clock.now()
        try:
            with trio.move_on_after(settings.timeout_s):
                await waiter.event.wait()
        except BaseException:
            # Cancelled (the client left, shutdown): leave the line, or pass on a slot
            # handed over in the same instant.
            if waiter.admitted:
                self._release(claims)
            else:
                self._queue.leave(waiter)
                self._left_queue += 1
            raise
        if not waiter.admitted:
            blocker = self._queue.leave(waiter)
            raise self._timed_out(blocker, claims)
        self._metrics.observe_wait(
            self.classes.name_of(claims.rank), claims.key, clock.now() - arrived
        )

    def _refusal(self, arrival: Arrival, claims: Claims) -> QueueFull:
        settings = self.settings
        if arrival is Arrival.TENANT_QUEUE_FULL:
            self._tenant_queue_full += 1
            return QueueFull(
                f"{_tenant_words(claims)} already has {claims.limits.max_queued} requests "
                f"waiting (its max_queued): try again later",
                settings.retry_after_s,
                limit="tenant_queue",
            )
        self._queue_full += 1
        stats = self._queue.statistics()
        return QueueFull(
            f"the router is serving {stats.active} requests and {stats.waiting} are waiting "
            f"(limits {settings.limit} and {settings.queue_size}): try again later",
            settings.retry_after_s,
        )

    def _timed_out(self, blocker: Blocker | None, claims: Claims) -> QueueTimeout:
        settings = self.settings
        if blocker is Blocker.TENANT_INFLIGHT:
            self._tenant_inflight_timeout += 1
            return QueueTimeout(
                f"waited {settings.timeout_s:g}s in the admission queue behind "
                f"{_tenant_words(claims)}'s own {claims.limits.max_inflight} requests in "
                "flight (its max_inflight)",
                settings.retry_after_s,
                limit="tenant_inflight",
            )
        self._queue_timeout += 1
        return QueueTimeout(
            f"waited {settings.timeout_s:g}s in the admission queue without a free slot "
            f"(--max-concurrent-requests {settings.limit})",
            settings.retry_after_s,
        )

    def _release(self, claims: Claims) -> None:
        """Give the slot back: to the waiters it admits now, or to nobody."""
        for waiter in self._queue.finish(claims.tenant):
            waiter.admitted = True
            waiter.event.set()


def _tenant_words(claims: Claims) -> str:
    key, sub = claims.tenant
    who = "the client without a key" if key == "-" else f"key '{key}'"
    return f"tenant '{sub}' of {who}" if sub else who


class AdmissionCollector(Collector):
    """The gate's gauges and counters, read at scrape time (the request path keeps plain
    ints). `by_tenant` adds the line's depth per key name (opt-in: one series per key)."""

    def __init__(self, gate: AdmissionGate, *, by_tenant: bool = False) -> None:
        self._gate = gate
        self._by_tenant = by_tenant

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        gate = self._gate
        stats = gate.statistics()
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
        by_class = GaugeMetricFamily(
            "router_admission_class_queue_depth",
            "Requests waiting in the admission queue, by priority class",
            labels=["class"],
        )
        for rank, waiting in enumerate(stats.waiting_by_class):
            by_class.add_metric([gate.classes.name_of(rank)], waiting)
        yield by_class
        by_tenant = GaugeMetricFamily(
            "router_admission_tenant_queue_depth",
            "Requests waiting in the admission queue, by client key name "
            "(with --admission-metrics-by-tenant; a key's header tenants summed under it)",
            labels=["tenant"],
        )
        if self._by_tenant:
            for key, waiting in sorted(gate.tenant_waiting().items()):
                by_tenant.add_metric([key], waiting)
        yield by_tenant
        refused = CounterMetricFamily(
            "router_admission_refused",
            "Requests that got no admission slot, by reason",
            labels=["reason"],
        )
        refused.add_metric(["queue_full"], stats.queue_full)
        refused.add_metric(["tenant_queue_full"], stats.tenant_queue_full)
        refused.add_metric(["queue_timeout"], stats.queue_timeout)
        refused.add_metric(["tenant_inflight_timeout"], stats.tenant_inflight_timeout)
        refused.add_metric(["client_left"], stats.left_queue)
        yield refused

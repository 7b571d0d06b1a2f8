"""Prometheus metrics of one router instance (a fresh registry each, so tests never share).

Per-request series are typed label children bound once per label value, so the hot path
pays one dict lookup and one increment, never a `labels()` call. Fleet-shaped gauges
(workers, in-flight, breaker state) are read from the fleet at scrape time by a
collector: the request path never touches them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

import router.http.upstream.pool
from router import __version__
from router.fleet.records import Mode, Role
from router.fleet.registry import Fleet
from router.http.upstream.pool import UpstreamPool

# Bound, not constrained: mypyc checks a generic body once, against the bound.
_Family = TypeVar("_Family", bound=MetricWrapperBase)

# Which build runs: "compiled" when the request path was built with mypyc (its modules
# are C extensions, see setup.py), "pure" when it runs as Python source.
BUILD = "compiled" if (router.http.upstream.pool.__file__ or "").endswith(".so") else "pure"

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class RouterMetrics:
    """The router's metric families, and their typed children, each bound once per label
    value the first time it is used (bounded sets: routes, statuses, modes, roles,
    reasons, kinds, the fleet's workers; a departed worker's child is dropped)."""

    def __init__(
        self,
        fleet: Fleet | None = None,
        registry: CollectorRegistry | None = None,
        *,
        key_label: bool = False,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # The `key` label exists only with named client keys; its values are those names.
        self.key_label = key_label
        request_labels = (
            ["model", "route", "status", "key"] if key_label else ["model", "route", "status"]
        )
        self.requests = Counter("router_requests", "Requests answered", request_labels, registry=r)
        self.duration = Histogram(
            "router_request_duration_seconds",
            "Time from request to the end of the answer",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "router_time_to_first_byte_seconds",
            "Time from request to the first answer byte sent",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "router_retries",
            "Attempts retried on another worker, by reason",
            ["reason"],
            registry=r,
        )
        self.breaker_trips = Counter(
            "router_worker_breaker_trips",
            "Breaker trips: closed to open (a failed probe re-opens without a new trip)",
            ["worker"],
            registry=r,
        )
        self.pd_requests = Counter(
            "router_pd_requests", "Generation requests by dispatch mode", ["mode"], registry=r
        )
        self.leg_failures = Counter(
            "router_leg_failures", "Pre-first-byte failures by leg role", ["role"], registry=r
        )
        self.discovery_up = Gauge(
            "router_discovery_up",
            "1 while the discovery source answers, 0 while it does not",
            registry=r,
        )
        self.discovery_events = Counter(
            "router_discovery_events", "Discovery events applied, by type", ["type"], registry=r
        )
        self.discovery_relists = Counter(
            "router_discovery_relists", "Full relists of the discovery source", registry=r
        )
        self.local_errors = Counter(
            "router_local_errors",
            "Requests refused for the router's own shortage (no worker blamed), by kind",
            ["kind"],
            registry=r,
        )
        self.discovery_up.set(1)
        Gauge(
            "router_build_info",
            "1, labelled with the router's version and build (compiled with mypyc, or pure)",
            ["build", "version"],
            registry=r,
        ).labels(BUILD, __version__).set(1)
        # Children bound once, when first used (a series appears with its first event, as
        # before): `labels()` takes a lock and builds a tuple every call.
        self._duration: dict[str, Histogram] = {}
        self._ttfb: dict[str, Histogram] = {}
        self._modes: dict[str, Counter] = {}
        self._leg_failures: dict[str, Counter] = {}
        self._requests: dict[tuple[str, str, int, str], Counter] = {}
        self._retries: dict[str, Counter] = {}
        self._local_errors: dict[str, Counter] = {}
        self._trips: dict[str, Counter] = {}
        self._fleet: Fleet | None = None
        if fleet is not None:
            self.watch_fleet(fleet)

    def watch_fleet(self, fleet: Fleet) -> None:
        """Export the fleet's gauges (read at scrape time); breaker trips are counted only
        for workers still in it."""
        self._fleet = fleet
        self.registry.register(_FleetCollector(fleet))

    def count_request(self, model: str, route: str, status: int, key: str | None = None) -> None:
        """Count one answered request; `key` is the client key's name (`-`: none), used only
        when the counter has the `key` label."""
        name = key or "-"
        child = self._requests.get((model, route, status, name))
        if child is None:
            values = (
                (model, route, str(status), name) if self.key_label else (model, route, str(status))
            )
            child = self._requests[(model, route, status, name)] = self.requests.labels(*values)
        child.inc()

    def observe_duration(self, route: str, seconds: float) -> None:
        _bound(self._duration, self.duration, route).observe(seconds)

    def observe_ttfb(self, route: str, seconds: float) -> None:
        _bound(self._ttfb, self.ttfb, route).observe(seconds)

    def count_retry(self, reason: str) -> None:
        _bound(self._retries, self.retries, reason).inc()

    def count_mode(self, mode: Mode) -> None:
        """Count a generation request under the mode it was first planned in."""
        _bound(self._modes, self.pd_requests, mode.value).inc()

    def count_leg_failure(self, role: Role) -> None:
        _bound(self._leg_failures, self.leg_failures, role.value).inc()

    def count_trip(self, worker_id: str) -> None:
        """Count a breaker trip of `worker_id`, unless the worker already left the fleet (its
        last request failing after it left): a departed worker gets no series back."""
        if self._fleet is not None and self._fleet.get(worker_id) is None:
            return
        _bound(self._trips, self.breaker_trips, worker_id).inc()

    def forget_worker(self, worker_id: str) -> None:
        """Drop the labelled series of a worker that left the fleet (the fleet-shaped
        gauges are read from the fleet at scrape time and need nothing)."""
        if self._trips.pop(worker_id, None) is not None:
            self.breaker_trips.remove(worker_id)

    def count_local_error(self, kind: str) -> None:
        _bound(self._local_errors, self.local_errors, kind).inc()

    def watch_pool(self, pool: UpstreamPool) -> None:
        """Export the upstream pool's connections, waiting checkouts and stale discards."""
        self.registry.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _bound(children: dict[str, _Family], family: _Family, value: str) -> _Family:
    """The child of `family` for one label value, bound the first time it is asked for."""
    child = children.get(value)
    if child is None:
        child = children[value] = family.labels(value)
    return child


class _FleetCollector(Collector):
    """Workers by model/role/status, in-flight and breaker state per worker, read at scrape."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # Scrapes come through the router's own handler, inside trio; the registry also
        # collects once at registration, outside any run, where no breaker can be open yet.
        try:
            now = trio.current_time()
        except RuntimeError:
            now = 0.0
        by_group: dict[tuple[str, str, str], int] = {}
        inflight = GaugeMetricFamily(
            "router_worker_inflight", "Requests in flight per worker", labels=["worker"]
        )
        state = GaugeMetricFamily(
            "router_worker_breaker_state",
            "Breaker state per worker: 0 closed, 1 open, 2 half_open",
            labels=["worker"],
        )
        healthy = GaugeMetricFamily(
            "router_worker_healthy", "1 when the worker passes its health checks", labels=["worker"]
        )
        for worker in self._fleet.workers():
            record = worker.record
            for model in record.models:
                key = (model, record.role.value, record.status.value)
                by_group[key] = by_group.get(key, 0) + 1
            inflight.add_metric([worker.id], worker.inflight)
            healthy.add_metric([worker.id], 1 if worker.healthy else 0)
            if worker.breaker is not None:
                state.add_metric([worker.id], int(worker.breaker.state(now)))
            else:
                state.add_metric([worker.id], 0)
        workers = GaugeMetricFamily(
            "router_workers",
            "Known workers by model, role and status",
            labels=["model", "role", "status"],
        )
        for (model, role, status), count in sorted(by_group.items()):
            workers.add_metric([model, role, status], count)
        remembered = GaugeMetricFamily(
            "router_models_remembered",
            "Models with no worker left that are still answered 503, not 404 (--model-memory-s)",
        )
        remembered.add_metric([], self._fleet.remembered_models(now))
        yield workers
        yield remembered
        yield GaugeMetricFamily(
            "router_workers_pending",
            "Workers named by discovery but not admitted: their engine has not stated their facts yet",
            value=len(self._fleet.pending),
        )
        yield inflight
        yield healthy
        yield state


class _PoolCollector(Collector):
    """The upstream pool's figures, read at scrape time (the request path pays nothing)."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._pool.statistics()
        connections = GaugeMetricFamily(
            "router_upstream_connections", "Open upstream connections by state", labels=["state"]
        )
        connections.add_metric(["idle"], stats.idle_total)
        connections.add_metric(["in_use"], stats.in_use)
        yield connections
        yield GaugeMetricFamily(
            "router_upstream_checkouts_waiting",
            "Requests waiting for a connection to a worker at --max-connections-per-worker",
            value=stats.waiting,
        )
        yield CounterMetricFamily(
            "router_upstream_stale_discarded",
            "Pooled connections found closed by the worker at checkout, discarded before any write",
            value=stats.stale_discarded,
        )

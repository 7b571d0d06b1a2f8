"""Prometheus metrics of one router instance (a fresh registry each, so tests never share).

Per-request counters are cached label children, so the hot path pays one dict lookup and
one increment. Fleet-shaped gauges (workers, in-flight, breaker state) are read from the
fleet at scrape time by a collector: the request path never touches them.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from router.http.pool import UpstreamPool
from router.workers import Fleet

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self, fleet: Fleet, registry: CollectorRegistry | None = None, *, key_label: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # The `key` label exists only with named client keys; its values are those names.
        self.key_label = key_label
        request_labels = ["model", "route", "status", "key"] if key_label else ["model", "route", "status"]
        self.requests = Counter("router_requests", "Requests answered", request_labels, registry=r)
        self.duration = Histogram(
            "router_request_duration_seconds", "Time from request to the end of the answer",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            "router_time_to_first_byte_seconds", "Time from request to the first answer byte sent",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.retries = Counter("router_retries", "Attempts retried on another worker, by reason", ["reason"], registry=r)
        self.breaker_trips = Counter("router_worker_breaker_trips", "Breaker trips: closed to open (a failed probe re-opens without a new trip)", ["worker"], registry=r)
        self.pd_requests = Counter("router_pd_requests", "Generation requests by dispatch mode", ["mode"], registry=r)
        self.leg_failures = Counter("router_leg_failures", "Pre-first-byte failures by leg role", ["role"], registry=r)
        self.discovery_up = Gauge("router_discovery_up", "1 while the discovery source answers, 0 while it does not", registry=r)
        self.discovery_events = Counter("router_discovery_events", "Discovery events applied, by type", ["type"], registry=r)
        self.discovery_relists = Counter("router_discovery_relists", "Full relists of the discovery source", registry=r)
        self.local_errors = Counter(
            "router_local_errors", "Requests refused for the router's own shortage (no worker blamed), by kind",
            ["kind"], registry=r,
        )
        self.discovery_up.set(1)
        r.register(_FleetCollector(fleet))
        self._children: dict[tuple[object, ...], object] = {}

    def child(self, metric: MetricWrapperBase, *labels: str) -> object:
        """A cached labelled child: `labels()` takes a lock and builds a tuple every call."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def count_request(self, model: str, route: str, status: int, key: str | None = None) -> None:
        """Count one answered request; `key` is the client key's name (`-`: none), used only
        when the counter has the `key` label."""
        if self.key_label:
            self.child(self.requests, model, route, str(status), key or "-").inc()  # type: ignore[attr-defined]
        else:
            self.child(self.requests, model, route, str(status)).inc()  # type: ignore[attr-defined]

    def observe_duration(self, route: str, seconds: float) -> None:
        self.child(self.duration, route).observe(seconds)  # type: ignore[attr-defined]

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self.child(self.ttfb, route).observe(seconds)  # type: ignore[attr-defined]

    def count_retry(self, reason: str) -> None:
        self.child(self.retries, reason).inc()  # type: ignore[attr-defined]

    def forget_worker(self, worker_id: str) -> None:
        """Drop the labelled series of a worker that left the fleet (the fleet-shaped
        gauges are read from the fleet at scrape time and need nothing)."""
        try:
            self.breaker_trips.remove(worker_id)
        except KeyError:
            pass  # it never tripped

    def count_local_error(self, kind: str) -> None:
        self.child(self.local_errors, kind).inc()  # type: ignore[attr-defined]

    def watch_pool(self, pool: UpstreamPool) -> None:
        """Export the upstream pool's connections, waiting checkouts and stale discards."""
        self.registry.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
        inflight = GaugeMetricFamily("router_worker_inflight", "Requests in flight per worker", labels=["worker"])
        state = GaugeMetricFamily(
            "router_worker_breaker_state", "Breaker state per worker: 0 closed, 1 open, 2 half_open", labels=["worker"]
        )
        healthy = GaugeMetricFamily("router_worker_healthy", "1 when the worker passes its health checks", labels=["worker"])
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
        workers = GaugeMetricFamily("router_workers", "Known workers by model, role and status", labels=["model", "role", "status"])
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
            "router_workers_pending", "Workers named by discovery but not admitted: their engine has not stated their facts yet",
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

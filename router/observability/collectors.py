"""What `/metrics` reads from the router's state when it is scraped: the fleet's workers,
in-flight counts and breakers, and the upstream pools' connections (HTTP and gRPC). The request path
never touches these figures; it pays nothing for them."""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.fleet.registry import Fleet
from router.http.grpc import GrpcPool
from router.http.upstream.pool import UpstreamPool


class FleetCollector(Collector):
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
        load = GaugeMetricFamily(
            "router_worker_load",
            "The load the policies read per worker: the engine's own count beyond this process plus this process's requests in flight, or only the latter while the engine's is unknown",
            labels=["worker"],
        )
        engine_load = GaugeMetricFamily(
            "router_worker_engine_load",
            "Requests the worker's engine held beyond this process's own at its last reading (other router processes and replicas, other clients); absent while unknown",
            labels=["worker"],
        )
        engine_load_age = GaugeMetricFamily(
            "router_worker_engine_load_age_seconds",
            "Age of the engine load reading behind router_worker_engine_load; absent while unknown",
            labels=["worker"],
        )
        unknown_load = 0
        for worker in self._fleet.workers():
            record = worker.record
            for model in record.models:
                key = (model, record.role.value, record.status.value)
                by_group[key] = by_group.get(key, 0) + 1
            inflight.add_metric([worker.id], worker.inflight)
            healthy.add_metric([worker.id], 1 if worker.healthy else 0)
            load.add_metric([worker.id], worker.load)
            if worker.shares:
                share = worker.engine_share()
                if share is None:
                    unknown_load += 1
                else:
                    engine_load.add_metric([worker.id], share[0])
                    engine_load_age.add_metric([worker.id], max(0.0, now - share[1]))
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
        yield load
        yield engine_load
        yield engine_load_age
        yield GaugeMetricFamily(
            "router_engine_load_unknown_workers",
            "Workers whose engine load is read but unknown now (never read yet, a failed, late or garbage reading, a silent stream): their load is this process's own count",
            value=unknown_load,
        )


class PoolCollector(Collector):
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


class GrpcPoolCollector(Collector):
    """The gRPC pool's connections and calls, read at scrape time."""

    def __init__(self, pool: GrpcPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._pool.statistics()
        yield GaugeMetricFamily(
            "router_grpc_connections",
            "Open HTTP/2 connections to grpc:// workers (at most one per worker)",
            value=stats.connections,
        )
        yield CounterMetricFamily(
            "router_grpc_connections_opened",
            "HTTP/2 connections opened to grpc:// workers",
            value=stats.opened,
        )
        calls = GaugeMetricFamily(
            "router_grpc_calls",
            "gRPC calls to grpc:// workers by state: open, or waiting at the per-worker cap",
            labels=["state"],
        )
        calls.add_metric(["open"], stats.calls_open)
        calls.add_metric(["waiting"], stats.calls_waiting)
        yield calls

"""The engine load readers on `/metrics`, read at scrape (the readers pay nothing)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.engines.load_reader import EngineLoads


class EngineLoadCollector(Collector):
    """Reads by source and outcome, and the readers running (registered whatever the
    policy, so the families exist: empty without a reader). The per-worker figures
    (`router_worker_load`, `router_worker_engine_load`, its age, the unknown count) come
    with the fleet's own series (`router.observability.collectors`)."""

    def __init__(self, loads: EngineLoads | None) -> None:
        self._loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        reads = CounterMetricFamily(
            "router_engine_load_reads",
            "Readings of the engines' own load by source (stream, loads, metrics, grpc_loads) and outcome (ok, partial, failed, timeout, bad_answer, silent)",
            labels=["source", "outcome"],
        )
        loads = self._loads
        if loads is not None:
            for (source, outcome), count in sorted(loads.reads.items()):
                reads.add_metric([source, outcome], count)
        yield reads
        yield GaugeMetricFamily(
            "router_engine_load_readers",
            "Workers whose engine load is being read",
            value=0 if loads is None else loads.readers(),
        )

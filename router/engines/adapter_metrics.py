"""The LoRA adapters of the fleet on `/metrics`, read at scrape (the readers pay nothing)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.engines.adapter_lists import OUTCOMES, AdapterLists


class AdapterCollector(Collector):
    """Reads of the engines' model lists by outcome, the readers running, routing misses,
    and the adapters held, in the fleet and per worker."""

    def __init__(self, lists: AdapterLists) -> None:
        self._lists = lists

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        lists = self._lists
        reads = CounterMetricFamily(
            "router_adapter_list_reads",
            "Readings of the engines' model lists for the LoRA adapters they hold, by outcome (ok, failed, timeout, bad_answer)",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            reads.add_metric([outcome], lists.reads[outcome])
        yield reads
        yield CounterMetricFamily(
            "router_adapter_list_refreshes",
            "Readings of an engine's model list asked for by a routing miss",
            value=lists.refreshes,
        )
        yield CounterMetricFamily(
            "router_adapter_misses",
            "Answers of 404 for a LoRA adapter the engine was thought to hold (failed over, never a breaker fault)",
            value=lists.misses,
        )
        yield GaugeMetricFamily(
            "router_adapter_list_readers",
            "Workers whose model list is being read for their adapters",
            value=lists.readers(),
        )
        fleet = lists.fleet
        yield GaugeMetricFamily(
            "router_adapters", "LoRA adapters some worker holds", value=len(fleet.adapters())
        )
        held = GaugeMetricFamily(
            "router_worker_adapters", "LoRA adapters each worker holds", labels=["worker"]
        )
        for worker in fleet.workers():
            held.add_metric([worker.id], len(worker.adapters.held))
        yield held

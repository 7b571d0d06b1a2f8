"""`/metrics` of the cache-aware policy: what its trees hold and how it decided, read from
the policies at scrape time (the request path never touches a metric for them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.cache_aware import CacheAware
from router.worker_record import Role


class CacheAwareCollector(Collector):
    """One series per role whose policy is `cache_aware`."""

    def __init__(self, policies: Mapping[Role, CacheAware]) -> None:
        self._policies = policies

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        chars = GaugeMetricFamily(
            "router_cache_aware_tree_chars",
            "Characters held by the cache_aware prefix trees (bounded by --max-tree-size per model)",
            labels=["role"],
        )
        nodes = GaugeMetricFamily(
            "router_cache_aware_tree_nodes",
            "Nodes of the cache_aware prefix trees",
            labels=["role"],
        )
        evicted = CounterMetricFamily(
            "router_cache_aware_evicted_chars",
            "Characters evicted from the cache_aware prefix trees",
            labels=["role"],
        )
        picks = CounterMetricFamily(
            "router_cache_aware_picks",
            "cache_aware picks by reason: balance (load check), match (prefix at or above the threshold), room (smallest tree)",
            labels=["role", "reason"],
        )
        for role, policy in self._policies.items():
            stats = policy.statistics()
            chars.add_metric([role.value], stats["tree_chars"])
            nodes.add_metric([role.value], stats["tree_nodes"])
            evicted.add_metric([role.value], stats["evicted_chars"])
            for reason in ("balance", "match", "room"):
                picks.add_metric([role.value, reason], stats[f"picks_by_{reason}"])
        yield chars
        yield nodes
        yield evicted
        yield picks

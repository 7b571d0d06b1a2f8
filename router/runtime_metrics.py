"""What the router process itself holds: upstream connections and trio tasks, read at scrape.

Both are resources a leak would grow without bound, so both are visible. They are read
when `/metrics` is scraped, never counted on the request path: the pool keeps its own
counters, and the task tree is walked from trio's root task.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.http.pool import UpstreamPool


def count_tasks() -> int | None:
    """Tasks alive in the current trio run, or None outside one (unknown, not zero)."""
    try:
        root = trio.lowlevel.current_root_task()
    except RuntimeError:
        return None
    if root is None:
        return None
    count = 0
    pending = [root]
    while pending:
        task = pending.pop()
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


class RuntimeCollector(Collector):
    """`router_upstream_connections{state}` and `router_tasks`, read at scrape time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._pool.statistics()
        connections = GaugeMetricFamily(
            "router_upstream_connections", "Upstream connections held, by state", labels=["state"]
        )
        connections.add_metric(["idle"], stats.idle_total)
        connections.add_metric(["in_use"], stats.in_use)
        yield connections
        tasks = count_tasks()
        # Outside a trio run (the registry's first collect at registration) the count is
        # unknown: the family is left out rather than reported as zero.
        if tasks is not None:
            family = GaugeMetricFamily("router_tasks", "trio tasks alive in this router process")
            family.add_metric([], tasks)
            yield family

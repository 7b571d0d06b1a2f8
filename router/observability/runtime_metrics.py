"""What the router process is and holds, read at scrape time: its build, and the trio
tasks alive in it.

The build is `compiled` when the request path runs as the C extensions mypyc built
(setup.py), `pure` when it runs from its Python sources: the same behaviour, a third less
CPU per request compiled (docs/performance.md, "The compiled build").

Tasks are a resource a leak grows without bound (a reader per client connection, a task
per request leg), so their number is visible. It is read when `/metrics` is scraped by
walking trio's task tree from its root, never counted on the request path.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import router
import router.api.errors


def build() -> str:
    """`compiled` when the request path was loaded from extensions, else `pure` (one of
    its modules stands for all: setup.py builds them together)."""
    return "pure" if router.api.errors.__file__.endswith(".py") else "compiled"


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


class TaskCollector(Collector):
    """`router_build_info` and `router_tasks`, read at scrape time."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            "router_build_info",
            "Always 1: the router's version, and its build (compiled: the request path as "
            "C extensions; pure: from its Python sources)",
            labels=["version", "build"],
        )
        info.add_metric([router.__version__, build()], 1)
        yield info
        tasks = count_tasks()
        # Outside a trio run (the registry's first collect at registration) the count is
        # unknown: the family is left out rather than reported as zero.
        if tasks is not None:
            family = GaugeMetricFamily("router_tasks", "trio tasks alive in this router process")
            family.add_metric([], tasks)
            yield family

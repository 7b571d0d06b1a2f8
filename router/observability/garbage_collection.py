"""Python's garbage collector in a serving router process: how it is set, and what it costs.

Most of a request's objects die by reference counting; the collector is for cycles. With
Python's own settings it runs a young collection every 700 net container allocations,
which under load is every few requests, and a full one every hundred young ones. A full
collection walks every object the process holds, tens of thousands of them built at
start (modules, classes, the app, the fleet) and never garbage, and stops every request
while it does: on a 2-core machine 15-20 ms, each time, which was most of the p99 at
c=32 (docs/performance.md, "The garbage collector").

`settle` is called once the router serves. It collects what start-up left, freezes what
is alive (`gc.freeze`: the full collections skip it from then on) and raises the young
threshold: under load there is then no collection at all (the requests' objects die by
reference counting) and the rare one walks only what was built since start. What a
frozen object costs: if it later becomes part of a cycle that is garbage (a worker known
at start that leaves the fleet, say) its memory is never reclaimed; that is bounded by
what existed at start. Cyclic garbage made later waits for at most `young_threshold` net
allocations before a collection finds it; the request path makes next to none, on its
failure paths too (a worker's reset, a broken stream, garbage, a first-byte timeout, a
client gone mid-stream: ~0 objects collected per request, docs/performance.md).

`PauseClock` times every collection (two clock reads a collection, not per request);
`GarbageCollectionCollector` exports the seconds by generation and the frozen count.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

DEFAULT_YOUNG_THRESHOLD = 100_000
"""Net container allocations between young collections once settled (Python's own: 700)."""


def settle(young_threshold: int) -> None:
    """Collect start-up's garbage, freeze what is left and set the young threshold;
    `0` leaves Python's settings as they are and freezes nothing."""
    if young_threshold < 0:
        raise ValueError(f"young_threshold must be >= 0, not {young_threshold}")
    if young_threshold == 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, oldest)


class PauseClock:
    """Seconds spent in collections, by generation, since `install` (one per process:
    `gc.callbacks` is the interpreter's). None before `install`: unknown, not zero."""

    def __init__(self) -> None:
        self.seconds: list[float] | None = None
        self._began = 0.0

    def install(self) -> None:
        if self.seconds is not None:
            return
        self.seconds = [0.0, 0.0, 0.0]
        gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self.seconds is None:
            return
        gc.callbacks.remove(self._on_collection)
        self.seconds = None

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = self.seconds
        if seconds is not None:
            seconds[info["generation"]] += time.perf_counter() - self._began


PAUSES = PauseClock()
"""This process's clock: `run_router` installs it when it builds its metrics (`settle` is
`router serve`'s alone: a router run inside another program, as `router demo` and the
tests do, leaves that program's collector as it is)."""


class GarbageCollectionCollector(Collector):
    """`router_gc_pause_seconds_total` by generation (left out until the clock is
    installed) and `router_gc_frozen_objects`, read at scrape time."""

    def __init__(self, clock: PauseClock = PAUSES) -> None:
        self._clock = clock

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        seconds = self._clock.seconds
        if seconds is not None:
            pauses = CounterMetricFamily(
                "router_gc_pause_seconds",
                "Seconds this process spent in Python's garbage collections (every request "
                "waits while one runs), by generation (2: the full collections)",
                labels=["generation"],
            )
            for generation, total in enumerate(seconds):
                pauses.add_metric([str(generation)], total)
            yield pauses
        frozen = GaugeMetricFamily(
            "router_gc_frozen_objects",
            "Objects frozen at start (gc.freeze): never walked by a collection",
        )
        frozen.add_metric([], gc.get_freeze_count())
        yield frozen

"""Counters and histograms counted on every request, kept as plain numbers and exported
when `/metrics` is scraped.

prometheus-client's counters and histograms are made for threads: every increment takes a
lock, checks that the metric may be observed, and a histogram's observation walks its
buckets one by one, each bucket its own locked value. The request path runs in one trio
thread, so the families it counts on every request are tallies instead: a counter is an
integer per label values in a dict, a histogram a list of bucket counts found by
bisection and a sum. The registry reads them as it reads the fleet
(`router.observability.collectors`), and the scrape shows what prometheus-client would:
the same names, types, samples and `_created` companions. Measured: docs/performance.md
("The lean path (issue 43), second round").

Not safe across threads; a tally belongs to the trio thread that counts in it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["CounterTally", "HistogramTally"]

K = TypeVar("K", bound=Hashable)


def _labels_as_given(key: Hashable) -> Sequence[str]:
    assert isinstance(key, tuple)
    return key


class CounterTally(Collector, Generic[K]):
    """A counter family: `inc(key)` counts one under `key`, whose label values
    `labels_of(key)` gives at scrape time (by default the key is the tuple of values)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        labels_of: Callable[[K], Sequence[str]] = _labels_as_given,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self._labels_of = labels_of
        self.counts: dict[K, int] = {}
        self._created: dict[K, float] = {}

    def inc(self, key: K) -> None:
        counts = self.counts
        count = counts.get(key)
        if count is None:
            self._created[key] = time.time()  # wall-clock: the exposition's `_created`
            counts[key] = 1
        else:
            counts[key] = count + 1

    def value(self, key: K) -> int:
        """The count under `key` (0 before its first)."""
        return self.counts.get(key, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, count in list(self.counts.items()):
            family.add_metric(self._labels_of(key), count, created=self._created[key])
        yield family


class _Observed:
    __slots__ = ("buckets", "created", "total")

    def __init__(self, size: int) -> None:
        self.buckets = [0] * size
        self.total = 0.0
        self.created = time.time()  # wall-clock: the exposition's `_created`


class HistogramTally(Collector):
    """A histogram family with one label: `observe(value, amount)`; buckets as
    prometheus-client's (each counts the observations at or below its bound, and +Inf)."""

    def __init__(
        self, name: str, documentation: str, labelname: str, buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelname = labelname
        self.bounds = tuple(float(bound) for bound in buckets)
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds:
            raise ValueError("histogram buckets must be distinct and in increasing order")
        self._series: dict[str, _Observed] = {}

    def observe(self, value: str, amount: float) -> None:
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = _Observed(len(self.bounds) + 1)
        # The first bound at or above the amount (+Inf past the last): prometheus-client's
        # `amount <= bound`, found by bisection instead of a walk.
        series.buckets[bisect_left(self.bounds, amount)] += 1
        series.total += amount

    def count(self, value: str) -> int:
        """Observations under `value` (0 before its first)."""
        series = self._series.get(value)
        return 0 if series is None else sum(series.buckets)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.labelname])
        bounds = [*(floatToGoString(bound) for bound in self.bounds), "+Inf"]
        for value, series in list(self._series.items()):
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip(bounds, series.buckets, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([value], buckets, series.total)
            family.add_sample(self.name + "_created", {self.labelname: value}, series.created)
        yield family

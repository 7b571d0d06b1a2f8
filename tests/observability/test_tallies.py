"""Tallies scrape as prometheus-client's own counters and histograms would for the same
events: names, types, samples, bucket bounds and `_created` companions."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.observability.tallies import CounterTally, HistogramTally

BUCKETS = (0.001, 0.01, 0.1, 1, 10)
AMOUNTS = (0.0, 0.001, 0.0010001, 0.05, 0.1, 3.0, 10.0, 11.0, 1e9)


def _without_created_values(text: bytes) -> str:
    # The `_created` samples carry the wall time of each series' first event: compare
    # that they are there, not when.
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())


def test_a_counter_tally_scrapes_as_a_prometheus_counter() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("router_requests", "Requests answered", ["model", "status"], registry=theirs)
    tally: CounterTally[tuple[str, int]] = CounterTally(
        "router_requests", "Requests answered", ["model", "status"], lambda k: (k[0], str(k[1]))
    )
    ours.register(tally)
    for model, status in [("m", 200), ("m", 200), ("x", 503), ("m", 404)]:
        counter.labels(model, str(status)).inc()
        tally.inc((model, status))
    assert _without_created_values(generate_latest(ours)) == _without_created_values(
        generate_latest(theirs)
    )
    assert tally.value(("m", 200)) == 2 and tally.value(("m", 201)) == 0


def test_a_histogram_tally_scrapes_as_a_prometheus_histogram_bucket_edges_included() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("d_seconds", "Durations", ["route"], buckets=BUCKETS, registry=theirs)
    tally = HistogramTally("d_seconds", "Durations", "route", BUCKETS)
    ours.register(tally)
    for route in ("chat", "completions"):
        for amount in AMOUNTS:
            histogram.labels(route).observe(amount)
            tally.observe(route, amount)
    assert _without_created_values(generate_latest(ours)) == _without_created_values(
        generate_latest(theirs)
    )
    assert tally.count("chat") == len(AMOUNTS) and tally.count("rerank") == 0


def test_buckets_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        HistogramTally("d", "D", "route", (1.0, 0.5))

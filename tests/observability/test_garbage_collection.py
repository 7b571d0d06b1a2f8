"""The collector's settings of a serving process, and the figures it exports."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.observability.garbage_collection import (
    DEFAULT_YOUNG_THRESHOLD,
    GarbageCollectionCollector,
    PauseClock,
    settle,
)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture(autouse=True)
def restored_collector() -> Iterator[None]:
    """Every test leaves the interpreter's collector as it found it."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def _garbage_cycle() -> weakref.ref[Node]:
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_settle_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    _, middle, oldest = gc.get_threshold()
    kept = Node()
    settle(12_345)
    assert gc.get_threshold() == (12_345, middle, oldest)
    assert gc.get_freeze_count() > 1_000  # the modules, classes and functions loaded so far
    assert gc.is_tracked(kept)
    assert all(tracked is not kept for tracked in gc.get_objects())  # frozen: in no generation


def test_settle_collects_start_ups_garbage_before_freezing_it() -> None:
    # A cycle already garbage at start would be frozen, never reclaimed, without the
    # collection first.
    gc.disable()
    try:
        cycle = _garbage_cycle()
        assert cycle() is not None
        settle(DEFAULT_YOUNG_THRESHOLD)
        assert cycle() is None
    finally:
        gc.enable()


def test_a_cycle_made_after_settling_is_still_collected() -> None:
    settle(DEFAULT_YOUNG_THRESHOLD)
    cycle = _garbage_cycle()
    assert cycle() is not None
    gc.collect()
    assert cycle() is None


def test_zero_leaves_pythons_settings_and_freezes_nothing() -> None:
    before = gc.get_threshold()
    settle(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        settle(-1)


def _scrape(collector: GarbageCollectionCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_pauses_are_unknown_until_the_clock_is_installed() -> None:
    clock = PauseClock()
    text = _scrape(GarbageCollectionCollector(clock))
    assert "router_gc_pause_seconds" not in text  # unknown, not zero
    assert "router_gc_frozen_objects 0.0" in text


def test_the_clock_counts_each_generations_seconds_and_frozen_objects_show() -> None:
    clock = PauseClock()
    callbacks = len(gc.callbacks)
    clock.install()
    try:
        clock.install()  # a second install adds no second callback
        assert len(gc.callbacks) == callbacks + 1
        gc.collect()  # a full collection
        gc.collect(0)
        assert clock.seconds is not None
        assert clock.seconds[2] > 0
        assert clock.seconds[0] > 0
        settle(DEFAULT_YOUNG_THRESHOLD)
        text = _scrape(GarbageCollectionCollector(clock))
    finally:
        clock.uninstall()
    assert len(gc.callbacks) == callbacks
    assert clock.seconds is None
    assert 'router_gc_pause_seconds_total{generation="2"}' in text
    frozen = next(
        line for line in text.splitlines() if line.startswith("router_gc_frozen_objects ")
    )
    # Frozen objects freed by reference counting leave the count: read it, not a copy.
    assert float(frozen.split()[1]) > 1_000

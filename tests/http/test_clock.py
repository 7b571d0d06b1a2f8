"""`router.http.clock`: `now()` reads the run's own clock, kept or not."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from router.http.clock import keep_clock, now, reader


def test_now_is_the_runs_clock_before_and_after_keep_clock() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    seen: list[tuple[float, float]] = []

    async def child() -> None:
        await trio.sleep(5)
        seen.append((now(), trio.current_time()))

    async def main() -> None:
        clock.jump(100)
        seen.append((now(), trio.current_time()))
        keep_clock()
        clock.jump(7)
        seen.append((now(), trio.current_time()))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)  # inherits the kept reader

    trio.run(main, clock=clock)
    assert seen == [(100.0, 100.0), (107.0, 107.0), (112.0, 112.0)]


def test_reader_reads_the_runs_clock_kept_or_not() -> None:
    clock = trio.testing.MockClock()
    seen: list[float] = []

    async def main() -> None:
        clock.jump(3)
        before = reader()  # nothing kept: the run's clock's own reader
        keep_clock()
        kept = reader()
        clock.jump(4)
        seen.extend((before(), kept(), trio.current_time()))

    trio.run(main, clock=clock)
    assert seen == [7.0, 7.0, 7.0]


def test_a_kept_clock_does_not_outlive_its_run() -> None:
    first = trio.testing.MockClock()
    first.jump(1000)

    async def keep() -> float:
        keep_clock()
        return now()

    assert trio.run(keep, clock=first) == 1000.0
    second = trio.testing.MockClock()
    assert trio.run(_now, clock=second) == 0.0  # the second run's clock, not the first's


async def _now() -> float:
    return now()


def test_now_outside_a_run_is_trios_error() -> None:
    with pytest.raises(RuntimeError):
        now()

"""The silence watch under virtual time: exact report times, probes bounded and spaced."""

from __future__ import annotations

import trio
import trio.testing

from router.discovery.liveness import SilenceWatch

SILENCE_S = 10.0


class Source:
    """A probe target: `answers` decides whether a probe returns, hangs or fails."""

    def __init__(self, answers: str) -> None:
        self.answers = answers
        self.probes: list[float] = []
        self.events: list[tuple[str, float]] = []

    async def probe(self) -> None:
        self.probes.append(trio.current_time())
        if self.answers == "hang":
            await trio.sleep_forever()
        if self.answers == "fail":
            raise ConnectionError("refused")
        await trio.sleep(0.1)

    def silent(self, quiet_s: float) -> None:
        self.events.append(("silent", quiet_s))

    def voice(self) -> None:
        self.events.append(("voice", trio.current_time()))


def watch_for(source: Source) -> SilenceWatch:
    return SilenceWatch(SILENCE_S, source.probe, (ConnectionError,), source.silent, source.voice)


async def test_a_frozen_source_is_reported_at_the_window_and_probed_each_half(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = Source("hang")
    async with trio.open_nursery() as nursery:
        watch = watch_for(source)
        nursery.start_soon(watch.serve)
        await trio.sleep_until(SILENCE_S - 0.001)
        await trio.testing.wait_all_tasks_blocked()
        assert source.events == [] and not watch.silent
        await trio.sleep_until(SILENCE_S)
        await trio.testing.wait_all_tasks_blocked()  # the watch runs at the same instant
        assert source.events == [("silent", SILENCE_S)] and watch.silent
        await trio.sleep(3 * SILENCE_S - 1)
        # One probe per half window, each given up after it; silence reported once.
        assert source.probes == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0]
        assert source.events == [("silent", SILENCE_S)]
        watch.heard()
        assert source.events == [("silent", SILENCE_S), ("voice", 39.0)] and not watch.silent
        await trio.sleep(SILENCE_S + 1)
        assert source.events[-1] == ("silent", SILENCE_S)  # silent again, reported again
        nursery.cancel_scope.cancel()


async def test_signs_of_life_keep_it_up_without_probes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = Source("hang")
    async with trio.open_nursery() as nursery:
        watch = watch_for(source)
        nursery.start_soon(watch.serve)
        for _ in range(20):  # a progress notification every 4 s
            await trio.sleep(4)
            watch.heard()
        assert source.events == [] and source.probes == []
        nursery.cancel_scope.cancel()


async def test_an_answered_probe_is_a_sign_of_life(autojump_clock: trio.testing.MockClock) -> None:
    source = Source("answer")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_for(source).serve)
        await trio.sleep(10 * SILENCE_S)
        assert source.events == []
        assert len(source.probes) == 19  # one per half window after the first
        nursery.cancel_scope.cancel()


async def test_failing_probes_are_spaced_not_a_busy_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = Source("fail")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_for(source).serve)
        await trio.sleep(2 * SILENCE_S + 1)
        assert source.probes == [5.0, 10.0, 15.0, 20.0]
        assert source.events == [("silent", SILENCE_S)]
        nursery.cancel_scope.cancel()

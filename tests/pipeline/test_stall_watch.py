"""One timer for every relayed stream: silence is measured while a relay waits on its
worker, never while it writes to its client; the timer's task lives only while streams do."""

from __future__ import annotations

import math

import trio
import trio.testing

from router.pipeline.stall_watch import StallWatch

IDLE_S = 10.0


def run(test: object) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def living_tasks() -> int:
    return trio.lowlevel.current_statistics().tasks_living


def test_a_relay_silent_for_idle_s_is_cancelled_at_that_moment() -> None:
    async def main() -> None:
        stalls = StallWatch(IDLE_S)
        start = trio.current_time()
        with trio.CancelScope() as scope:
            watched = stalls.watch(scope.cancel)
            await trio.sleep_forever()
        assert scope.cancelled_caught and watched.stalled
        assert trio.current_time() - start == IDLE_S
        assert stalls.watched == 0

    run(main)


def test_writing_to_the_client_is_never_silence() -> None:
    async def main() -> None:
        stalls = StallWatch(IDLE_S)
        with trio.CancelScope() as scope:
            watched = stalls.watch(scope.cancel)
            watched.waiting_since = math.inf
            await trio.sleep(10 * IDLE_S)  # a slow client
            resumed = trio.current_time()
            watched.waiting_since = resumed
            await trio.sleep_forever()
        assert watched.stalled
        assert trio.current_time() - resumed == IDLE_S

    run(main)


def test_events_closer_than_idle_s_keep_the_stream_alive() -> None:
    async def main() -> None:
        stalls = StallWatch(IDLE_S)
        with trio.CancelScope() as scope:
            watched = stalls.watch(scope.cancel)
            for _ in range(50):
                await trio.sleep(IDLE_S * 0.9)
                watched.waiting_since = trio.current_time()
            stalls.forget(watched)
        assert not scope.cancelled_caught and not watched.stalled

    run(main)


def test_each_stream_is_due_on_its_own_time() -> None:
    async def main() -> None:
        stalls = StallWatch(IDLE_S)
        ended: dict[int, float] = {}
        start = trio.current_time()

        async def relay(index: int) -> None:
            await trio.sleep(index)
            with trio.CancelScope() as scope:
                stalls.watch(scope.cancel)
                await trio.sleep_forever()
            ended[index] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            for index in range(5):
                nursery.start_soon(relay, index)
        assert ended == {index: index + IDLE_S for index in range(5)}

    run(main)


def test_the_timer_task_lives_only_while_streams_are_watched() -> None:
    async def main() -> None:
        stalls = StallWatch(IDLE_S)
        before = living_tasks()
        with trio.CancelScope() as scope:
            first = stalls.watch(scope.cancel)
            second = stalls.watch(scope.cancel)
            await trio.testing.wait_all_tasks_blocked()
            assert living_tasks() == before + 1
            stalls.forget(first)
            await trio.testing.wait_all_tasks_blocked()
            assert living_tasks() == before + 1
            stalls.forget(second)
        await trio.testing.wait_all_tasks_blocked()
        assert living_tasks() == before
        # And it starts again with the next stream.
        with trio.CancelScope() as scope:
            stalls.watch(scope.cancel)
            await trio.sleep_forever()
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        assert living_tasks() == before

    run(main)


def test_served_for_the_router_lifetime_no_task_starts_per_stream() -> None:
    async def main() -> None:
        stalls = StallWatch(IDLE_S)
        async with trio.open_nursery() as nursery:
            await nursery.start(stalls.serve)
            before = living_tasks()
            for _ in range(3):
                with trio.CancelScope() as scope:
                    entry = stalls.watch(scope.cancel)
                    await trio.testing.wait_all_tasks_blocked()
                    assert living_tasks() == before
                    stalls.forget(entry)
            # Still the one timer for stalls: a silent stream ends at idle_s.
            start = trio.current_time()
            with trio.CancelScope() as scope:
                watched = stalls.watch(scope.cancel)
                await trio.sleep_forever()
            assert watched.stalled and trio.current_time() - start == IDLE_S
            assert living_tasks() == before
            nursery.cancel_scope.cancel()

    run(main)

"""The circuit breaker under a mock clock: thresholds, exact cooldowns, the single probe."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from router.fleet.breaker import (
    BreakerSettings,
    BreakerState,
    BreakerStatistics,
    CircuitBreaker,
    Outcome,
    Permit,
    make_breaker,
)

CLOSED = BreakerState.CLOSED
OPEN = BreakerState.OPEN
HALF_OPEN = BreakerState.HALF_OPEN

Transition = tuple[str, BreakerState, BreakerState, float]
# The edges of one outage that ended with a successful probe.
RECOVERED = [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


class Transitions:
    """Collects on_transition calls so tests can count them."""

    def __init__(self) -> None:
        self.calls: list[Transition] = []

    def __call__(self, name: str, old: BreakerState, new: BreakerState, now: float) -> None:
        self.calls.append((name, old, new, now))

    def edges(self) -> list[tuple[BreakerState, BreakerState]]:
        return [(old, new) for _, old, new, _ in self.calls]


def new_breaker(
    threshold: int = 3, cooldown: float = 5.0, cap: float = 60.0
) -> tuple[CircuitBreaker, Transitions]:
    log = Transitions()
    breaker = CircuitBreaker(
        BreakerSettings(failure_threshold=threshold, cooldown_s=cooldown, max_cooldown_s=cap),
        name="w1",
        on_transition=log,
    )
    return breaker, log


def now() -> float:
    return trio.current_time()


def dispatch(breaker: CircuitBreaker, outcome: Outcome, *, force: bool = False) -> Permit:
    permit = breaker.acquire(now(), force=force)
    assert permit is not None
    breaker.record(permit, outcome, now())
    return permit


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.settings.failure_threshold):
        dispatch(breaker, Outcome.FAULT)
    assert breaker.state(now()) is OPEN


async def half_open() -> tuple[CircuitBreaker, Transitions]:
    """A new breaker (the defaults of `new_breaker`) tripped now and left for its whole
    cooldown: half-open, its probe slot free."""
    breaker, log = new_breaker()
    trip(breaker)
    await trio.sleep(breaker.settings.cooldown_s)
    return breaker, log


def probe(breaker: CircuitBreaker) -> Permit:
    permit = breaker.acquire(now())
    assert permit == Permit(probe=True, forced=False, cycle=breaker.statistics(now()).trips)
    return permit


async def test_opens_at_exactly_threshold_consecutive_faults(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = new_breaker(threshold=3)
    dispatch(breaker, Outcome.FAULT)
    await trio.sleep(1)
    dispatch(breaker, Outcome.FAULT)
    assert breaker.state(now()) is CLOSED
    assert breaker.available(now())
    assert breaker.statistics(now()).consecutive_faults == 2
    assert log.calls == []

    await trio.sleep(1)
    dispatch(breaker, Outcome.FAULT)
    assert breaker.state(now()) is OPEN
    assert not breaker.available(now())
    assert breaker.acquire(now()) is None
    assert log.calls == [("w1", CLOSED, OPEN, 2.0)]
    assert breaker.statistics(now()).trips == 1


async def test_success_resets_the_fault_count(autojump_clock: trio.testing.MockClock) -> None:
    breaker, log = new_breaker(threshold=3)
    for outcome in [Outcome.FAULT, Outcome.FAULT, Outcome.SUCCESS, Outcome.FAULT, Outcome.FAULT]:
        dispatch(breaker, outcome)
    assert breaker.state(now()) is CLOSED
    assert breaker.statistics(now()).consecutive_faults == 2

    dispatch(breaker, Outcome.FAULT)
    assert breaker.state(now()) is OPEN
    assert len(log.calls) == 1


async def test_neutral_outcomes_never_trip_and_never_reset(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 4xx, 429, client disconnects and mid-stream failures: one bad client sending 400s to
    # every worker must not trip the fleet.
    breaker, log = new_breaker(threshold=3)
    for _ in range(100):
        dispatch(breaker, Outcome.NEUTRAL)
    assert breaker.statistics(now()) == BreakerStatistics(
        state=CLOSED,
        consecutive_faults=0,
        cooldown_s=5.0,
        next_probe_at=None,
        trips=0,
        probe_in_flight=False,
    )
    # Nor does a neutral outcome reset a run of faults.
    for outcome in [Outcome.FAULT, Outcome.FAULT, Outcome.NEUTRAL, Outcome.FAULT]:
        dispatch(breaker, outcome)
    assert breaker.state(now()) is OPEN
    assert len(log.calls) == 1


async def test_cooldown_boundary_is_exact(autojump_clock: trio.testing.MockClock) -> None:
    breaker, log = new_breaker(cooldown=5.0)
    trip(breaker)
    assert now() == 0.0

    autojump_clock.jump(5.0 - 0.001)
    assert breaker.state(now()) is OPEN
    assert not breaker.available(now())
    assert breaker.acquire(now()) is None
    assert breaker.retry_after(now()) == pytest.approx(0.001)

    autojump_clock.jump(0.001)
    assert now() == 5.0
    assert breaker.state(now()) is HALF_OPEN
    assert breaker.available(now())
    assert breaker.retry_after(now()) == 0.0
    assert log.calls == [("w1", CLOSED, OPEN, 0.0), ("w1", OPEN, HALF_OPEN, 5.0)]


async def test_failed_probes_double_the_cooldown_up_to_the_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = new_breaker(cooldown=5.0, cap=60.0)
    trip(breaker)
    seen: list[float] = []
    for _ in range(6):
        stats = breaker.statistics(now())
        cooldown = stats.cooldown_s
        seen.append(cooldown)
        assert stats.next_probe_at == now() + cooldown
        # One millisecond short of the deadline nothing is admitted, not even a probe.
        assert breaker.acquire(now() + cooldown - 0.001) is None
        await trio.sleep(cooldown)
        permit = probe(breaker)
        breaker.record(permit, Outcome.FAULT, now())
        assert breaker.state(now()) is OPEN
    assert seen == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert breaker.statistics(now()).cooldown_s == 60.0
    assert now() == 5.0 + 10.0 + 20.0 + 40.0 + 60.0 + 60.0

    await trio.sleep(60.0)
    breaker.record(probe(breaker), Outcome.SUCCESS, now())
    assert breaker.state(now()) is CLOSED
    assert breaker.statistics(now()).cooldown_s == 5.0

    trip(breaker)
    assert breaker.statistics(now()).next_probe_at == now() + 5.0
    # One trip per outage: probe failures re-open without counting as new trips.
    assert breaker.statistics(now()).trips == 2
    assert log.edges().count((HALF_OPEN, OPEN)) == 6
    assert log.edges().count((CLOSED, OPEN)) == 2


async def test_one_probe_among_fifty_concurrent_dispatches(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = await half_open()
    permits: list[Permit | None] = []

    async def request() -> None:
        permit = breaker.acquire(now())
        permits.append(permit)
        await trio.sleep(0.25)
        if permit is not None:
            breaker.record(permit, Outcome.SUCCESS, now())

    async with trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(request)
        await trio.sleep(0.1)
        assert breaker.statistics(now()).probe_in_flight
        assert not breaker.available(now())

    assert now() == 5.25
    assert sum(1 for p in permits if p is not None and p.probe) == 1
    assert permits.count(None) == 49
    assert breaker.state(now()) is CLOSED
    assert log.edges() == RECOVERED
    assert log.calls[-1][3] == 5.25


async def test_all_open_dispatch_of_fifty_takes_one_probe_and_forces_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, _ = await half_open()
    permits = [breaker.acquire(now(), force=True) for _ in range(50)]
    assert sum(1 for p in permits if p is not None and p.probe) == 1
    assert sum(1 for p in permits if p is not None and p.forced) == 49


async def test_neutral_probe_frees_the_slot(autojump_clock: trio.testing.MockClock) -> None:
    # A probe whose client went away says nothing about the worker.
    breaker, log = await half_open()
    first = probe(breaker)
    assert breaker.acquire(now()) is None
    await trio.sleep(1.0)
    breaker.record(first, Outcome.NEUTRAL, now())
    assert breaker.state(now()) is HALF_OPEN
    assert breaker.available(now())
    assert breaker.statistics(now()).cooldown_s == 5.0

    second = probe(breaker)
    breaker.record(second, Outcome.SUCCESS, now())
    assert breaker.state(now()) is CLOSED
    assert log.edges() == RECOVERED


async def test_a_cancelled_probe_reports_neutral_and_frees_the_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, _ = await half_open()
    permit = probe(breaker)
    with trio.move_on_after(2.0) as scope:
        try:
            await trio.sleep(30.0)
        finally:
            breaker.record(permit, Outcome.NEUTRAL, now())
    assert scope.cancelled_caught
    assert now() == 7.0
    assert breaker.statistics(now()).probe_in_flight is False
    assert probe(breaker).probe


async def test_force_never_takes_the_probe_slot(autojump_clock: trio.testing.MockClock) -> None:
    breaker, _ = new_breaker()
    assert breaker.acquire(now(), force=True) == Permit(probe=False, forced=False, cycle=0)
    trip(breaker)
    assert breaker.acquire(now()) is None
    forced = breaker.acquire(now(), force=True)
    assert forced == Permit(probe=False, forced=True, cycle=1)
    assert breaker.statistics(now()).probe_in_flight is False

    await trio.sleep(5.0)
    # With the slot free, force is not needed: the dispatch is the probe.
    assert breaker.acquire(now(), force=True) == Permit(probe=True, forced=False, cycle=1)
    assert breaker.acquire(now(), force=True) == Permit(probe=False, forced=True, cycle=1)
    assert breaker.acquire(now()) is None


async def test_forced_success_closes_and_resets_the_cooldown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = await half_open()
    breaker.record(probe(breaker), Outcome.FAULT, now())
    assert breaker.statistics(now()).cooldown_s == 10.0

    await trio.sleep(2.0)
    dispatch(breaker, Outcome.SUCCESS, force=True)
    assert breaker.statistics(now()) == BreakerStatistics(
        state=CLOSED,
        consecutive_faults=0,
        cooldown_s=5.0,
        next_probe_at=None,
        trips=1,
        probe_in_flight=False,
    )
    assert log.calls[-1] == ("w1", OPEN, CLOSED, 7.0)


async def test_forced_fault_rearms_from_now_without_doubling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = new_breaker()
    trip(breaker)
    await trio.sleep(3.0)
    dispatch(breaker, Outcome.FAULT, force=True)
    stats = breaker.statistics(now())
    assert (stats.state, stats.cooldown_s, stats.next_probe_at) == (OPEN, 5.0, 8.0)
    assert stats.trips == 1
    assert len(log.calls) == 1

    await trio.sleep(5.0 - 0.001)
    assert breaker.state(now()) is OPEN
    await trio.sleep(0.001)
    assert breaker.state(now()) is HALF_OPEN

    # Half-open with the slot free: a forced fault puts it back to open, still undoubled.
    forced = breaker.acquire(now(), force=True)
    assert forced is not None and forced.probe
    breaker.record(forced, Outcome.NEUTRAL, now())
    late = Permit(probe=False, forced=True, cycle=1)
    breaker.record(late, Outcome.FAULT, now())
    stats = breaker.statistics(now())
    assert (stats.state, stats.cooldown_s, stats.next_probe_at) == (OPEN, 5.0, now() + 5.0)
    assert log.edges() == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN)]


async def test_forced_verdicts_while_a_probe_is_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = await half_open()
    the_probe = probe(breaker)
    forced = breaker.acquire(now(), force=True)
    assert forced is not None and forced.forced

    # The probe owns this window: a forced fault changes nothing.
    breaker.record(forced, Outcome.FAULT, now())
    assert breaker.statistics(now()).state is HALF_OPEN
    assert breaker.statistics(now()).probe_in_flight

    # A forced success closes it, and the probe's later fault is stale.
    dispatch_forced = breaker.acquire(now(), force=True)
    assert dispatch_forced is not None
    breaker.record(dispatch_forced, Outcome.SUCCESS, now())
    assert breaker.state(now()) is CLOSED
    breaker.record(the_probe, Outcome.FAULT, now())
    assert breaker.statistics(now()).state is CLOSED
    assert breaker.statistics(now()).consecutive_faults == 0
    assert breaker.statistics(now()).trips == 1
    assert log.edges() == RECOVERED


async def test_forced_neutral_changes_nothing(autojump_clock: trio.testing.MockClock) -> None:
    breaker, log = new_breaker()
    trip(breaker)
    before = breaker.statistics(now())
    await trio.sleep(1.0)
    dispatch(breaker, Outcome.NEUTRAL, force=True)
    assert breaker.statistics(now()) == before
    assert len(log.calls) == 1


async def test_late_verdicts_of_closed_permits_neither_extend_nor_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = new_breaker(threshold=3)
    outstanding = [Permit(probe=False, forced=False, cycle=0)] * 5
    assert [breaker.acquire(now()) for _ in range(5)] == outstanding
    trip(breaker)

    await trio.sleep(1.0)
    breaker.record(outstanding[0], Outcome.FAULT, now())
    breaker.record(outstanding[1], Outcome.FAULT, now())
    breaker.record(outstanding[2], Outcome.SUCCESS, now())
    stats = breaker.statistics(now())
    assert (stats.state, stats.next_probe_at, stats.cooldown_s, stats.trips) == (OPEN, 5.0, 5.0, 1)

    await trio.sleep(4.0)
    breaker.record(probe(breaker), Outcome.SUCCESS, now())
    # Closed again: faults from the previous closed period do not count towards a new trip.
    breaker.record(outstanding[3], Outcome.FAULT, now())
    breaker.record(outstanding[4], Outcome.FAULT, now())
    assert breaker.statistics(now()).consecutive_faults == 0
    assert len(log.calls) == 3


async def test_stale_forced_permit_from_an_earlier_outage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = new_breaker(threshold=1)
    trip(breaker)
    old_forced = breaker.acquire(now(), force=True)
    assert old_forced is not None
    await trio.sleep(5.0)
    breaker.record(probe(breaker), Outcome.SUCCESS, now())
    # The outage it was granted in is over: its fault does not trip the closed breaker.
    breaker.record(old_forced, Outcome.FAULT, now())
    breaker.record(old_forced, Outcome.SUCCESS, now())
    assert breaker.statistics(now()).consecutive_faults == 0
    assert breaker.state(now()) is CLOSED
    assert log.edges() == RECOVERED
    trip(breaker)
    # A success from the first outage says nothing about the second.
    breaker.record(old_forced, Outcome.SUCCESS, now())
    assert breaker.state(now()) is OPEN
    assert breaker.statistics(now()).trips == 2


async def test_retry_after(autojump_clock: trio.testing.MockClock) -> None:
    breaker, _ = new_breaker()
    assert breaker.retry_after(now()) == 0.0
    trip(breaker)
    assert breaker.retry_after(now()) == 5.0
    await trio.sleep(2.0)
    assert breaker.retry_after(now()) == 3.0
    await trio.sleep(3.0)
    assert breaker.retry_after(now()) == 0.0
    permit = probe(breaker)
    # Nobody knows when a probe in flight finishes: the cooldown is the estimate.
    assert breaker.retry_after(now()) == 5.0
    await trio.sleep(1.0)
    breaker.record(permit, Outcome.FAULT, now())
    assert breaker.retry_after(now()) == 10.0
    await trio.sleep(9.0)
    assert breaker.retry_after(now()) == 1.0


async def test_retry_after_never_exceeds_the_cooldown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # (3.3 + 5.0) - 3.3 rounds to 5.000000000000001, which a caller rounding up for the
    # Retry-After header would turn into 6 seconds.
    breaker, _ = new_breaker(cooldown=5.0)
    await trio.sleep(3.3)
    trip(breaker)
    assert breaker.retry_after(now()) == 5.0


async def test_half_open_is_reported_once_per_cycle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    breaker, log = new_breaker()
    trip(breaker)
    await trio.sleep(7.0)
    # Nothing has looked since the deadline passed, so nothing has been reported yet.
    assert len(log.calls) == 1
    for _ in range(10):
        breaker.state(now())
        breaker.available(now())
        breaker.statistics(now())
        breaker.retry_after(now())
    assert log.calls == [("w1", CLOSED, OPEN, 0.0), ("w1", OPEN, HALF_OPEN, 7.0)]

    breaker.record(probe(breaker), Outcome.FAULT, now())
    await trio.sleep(10.0)
    assert breaker.acquire(now()) is not None
    assert breaker.acquire(now()) is None
    assert log.edges() == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN)]
    assert [t[3] for t in log.calls] == [0.0, 7.0, 7.0, 17.0]


async def test_statistics_through_a_cycle(autojump_clock: trio.testing.MockClock) -> None:
    breaker, _ = new_breaker(threshold=2)
    dispatch(breaker, Outcome.FAULT)
    await trio.sleep(1.0)
    dispatch(breaker, Outcome.FAULT)
    assert breaker.statistics(now()) == BreakerStatistics(
        state=OPEN,
        consecutive_faults=2,
        cooldown_s=5.0,
        next_probe_at=6.0,
        trips=1,
        probe_in_flight=False,
    )
    await trio.sleep(5.0)
    assert breaker.statistics(now()).state is HALF_OPEN
    assert breaker.statistics(now()).next_probe_at == 6.0
    permit = probe(breaker)
    assert breaker.statistics(now()) == BreakerStatistics(
        state=HALF_OPEN,
        consecutive_faults=2,
        cooldown_s=5.0,
        next_probe_at=None,
        trips=1,
        probe_in_flight=True,
    )
    breaker.record(permit, Outcome.SUCCESS, now())
    assert breaker.statistics(now()) == BreakerStatistics(
        state=CLOSED,
        consecutive_faults=0,
        cooldown_s=5.0,
        next_probe_at=None,
        trips=1,
        probe_in_flight=False,
    )


def test_make_breaker() -> None:
    assert make_breaker(BreakerSettings(failure_threshold=0), "w1") is None
    breaker = make_breaker(BreakerSettings(failure_threshold=1), "w1")
    assert breaker is not None
    assert breaker.name == "w1"
    assert breaker.state(0.0) is CLOSED
    with pytest.raises(ValueError, match="threshold 0 is disabled"):
        CircuitBreaker(BreakerSettings(failure_threshold=0))


def test_state_values_are_the_metric_values() -> None:
    assert [int(s) for s in (CLOSED, OPEN, HALF_OPEN)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failure_threshold": -1}, "failure threshold must be an integer >= 0"),
        # Compiled (setup.py), a value of the wrong type is a TypeError at the call.
        pytest.param(
            {"failure_threshold": 1.5},
            "failure threshold must be an integer >= 0",
            marks=pytest.mark.pure_only,
        ),
        pytest.param(
            {"failure_threshold": True},
            "failure threshold must be an integer >= 0",
            marks=pytest.mark.pure_only,
        ),
        ({"cooldown_s": 0}, "cooldown must be a finite number of seconds > 0"),
        ({"cooldown_s": -1.0}, "cooldown must be a finite number of seconds > 0"),
        ({"cooldown_s": float("nan")}, "cooldown must be a finite number of seconds > 0"),
        ({"cooldown_s": 10.0, "max_cooldown_s": 5.0}, r"max cooldown .* >= the cooldown"),
        ({"max_cooldown_s": float("inf")}, r"max cooldown must be a finite number"),
    ],
)
def test_settings_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BreakerSettings(**kwargs)  # type: ignore[arg-type]


def test_settings_accept_the_edges() -> None:
    assert BreakerSettings(failure_threshold=0).failure_threshold == 0
    assert BreakerSettings(cooldown_s=7, max_cooldown_s=7).max_cooldown_s == 7

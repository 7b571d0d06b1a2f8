"""The breaker against a reference model, driven by random interleavings of dispatches.

The breaker is synchronous and takes `now` from its caller, so the machine drives time as
a plain float. The model tracks staleness its own way, by killing outstanding permits when
a cycle ends, rather than by the cycle number the breaker stamps on each permit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from router.fleet.breaker import (
    BreakerSettings,
    BreakerState,
    BreakerStatistics,
    CircuitBreaker,
    Outcome,
    Permit,
)

CLOSED = BreakerState.CLOSED
OPEN = BreakerState.OPEN
HALF_OPEN = BreakerState.HALF_OPEN


class Kind(enum.Enum):
    PLAIN = "plain"
    PROBE = "probe"
    FORCED = "forced"


@dataclass
class Outstanding:
    permit: Permit
    kind: Kind
    live: bool = True


class Model:
    """What the breaker should do, written as the design states it."""

    def __init__(self, threshold: int, base: float, cap: float) -> None:
        self.threshold = threshold
        self.base = base
        self.cap = cap
        self.state = CLOSED
        self.faults = 0
        self.cooldown = base
        self.deadline = 0.0
        self.trips = 0
        self.probe: Outstanding | None = None
        self.outstanding: list[Outstanding] = []
        self.transitions: list[tuple[BreakerState, BreakerState, float]] = []

    def move(self, new: BreakerState, now: float) -> None:
        self.transitions.append((self.state, new, now))
        self.state = new

    def tick(self, now: float) -> None:
        if self.state is OPEN and now >= self.deadline:
            self.move(HALF_OPEN, now)

    def admit(self, now: float, force: bool) -> Kind | None:
        self.tick(now)
        if self.state is CLOSED:
            return Kind.PLAIN
        if self.state is HALF_OPEN and self.probe is None:
            return Kind.PROBE
        return Kind.FORCED if force else None

    def open(self, now: float) -> None:
        self.deadline = now + self.cooldown
        self.move(OPEN, now)

    def close(self, now: float) -> None:
        self.faults = 0
        self.cooldown = self.base
        self.probe = None
        for entry in self.outstanding:
            if entry.kind is not Kind.PLAIN:
                entry.live = False
        self.move(CLOSED, now)

    def record(self, entry: Outstanding, outcome: Outcome, now: float) -> None:
        self.tick(now)
        if entry.kind is Kind.PROBE and self.probe is entry:
            self.probe = None
        if not entry.live:
            return
        if entry.kind is Kind.PLAIN:
            if outcome is Outcome.SUCCESS:
                self.faults = 0
            elif outcome is Outcome.FAULT:
                self.faults += 1
                if self.faults >= self.threshold:
                    self.trips += 1
                    for other in self.outstanding:
                        if other.kind is Kind.PLAIN:
                            other.live = False
                    self.open(now)
        elif entry.kind is Kind.PROBE:
            if outcome is Outcome.SUCCESS:
                self.close(now)
            elif outcome is Outcome.FAULT:
                self.cooldown = min(2 * self.cooldown, self.cap)
                self.open(now)
        elif outcome is Outcome.SUCCESS:
            self.close(now)
        elif outcome is Outcome.FAULT and self.probe is None:
            if self.state is HALF_OPEN:
                self.open(now)
            else:
                self.deadline = now + self.cooldown

    def statistics(self) -> BreakerStatistics:
        next_probe_at = None
        if self.state is not CLOSED and self.probe is None:
            next_probe_at = self.deadline
        return BreakerStatistics(
            state=self.state,
            consecutive_faults=self.faults,
            cooldown_s=self.cooldown,
            next_probe_at=next_probe_at,
            trips=self.trips,
            probe_in_flight=self.probe is not None,
        )


STEPS = st.sampled_from([0.0, 0.001, 0.5, 1.0, 2.5, 4.999, 5.0, 10.0, 30.0, 61.0])


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.seen: list[tuple[BreakerState, BreakerState, float]] = []
        self.breaker = CircuitBreaker(BreakerSettings(), name="w", on_transition=self._saw)
        self.model = Model(3, 5.0, 60.0)

    def _saw(self, name: str, old: BreakerState, new: BreakerState, now: float) -> None:
        assert name == "w"
        self.seen.append((old, new, now))

    @initialize(
        threshold=st.integers(1, 4),
        base=st.sampled_from([1.0, 5.0]),
        factor=st.sampled_from([1, 3, 12]),
    )
    def configure(self, threshold: int, base: float, factor: int) -> None:
        cap = base * factor
        self.breaker = CircuitBreaker(
            BreakerSettings(failure_threshold=threshold, cooldown_s=base, max_cooldown_s=cap),
            name="w",
            on_transition=self._saw,
        )
        self.model = Model(threshold, base, cap)

    def _acquire(self, count: int, force: bool) -> None:
        for _ in range(count):
            expected = self.model.admit(self.now, force)
            permit = self.breaker.acquire(self.now, force=force)
            if expected is None:
                assert permit is None
                continue
            assert permit is not None
            assert permit.probe == (expected is Kind.PROBE)
            assert permit.forced == (expected is Kind.FORCED)
            # Never a non-forced permit while open.
            assert permit.forced or self.model.state is not OPEN
            entry = Outstanding(permit, expected)
            if expected is Kind.PROBE:
                self.model.probe = entry
            self.model.outstanding.append(entry)

    @rule(count=st.integers(1, 20))
    def acquire(self, count: int) -> None:
        self._acquire(count, force=False)

    @rule(count=st.integers(1, 5))
    def force_acquire(self, count: int) -> None:
        self._acquire(count, force=True)

    @precondition(lambda self: bool(self.model.outstanding))
    @rule(
        data=st.data(),
        outcome=st.sampled_from([Outcome.SUCCESS, Outcome.FAULT, Outcome.NEUTRAL]),
    )
    def record(self, data: st.DataObject, outcome: Outcome) -> None:
        index = data.draw(st.integers(0, len(self.model.outstanding) - 1), label="permit")
        entry = self.model.outstanding.pop(index)
        self.breaker.record(entry.permit, outcome, self.now)
        self.model.record(entry, outcome, self.now)

    @rule(step=STEPS)
    def advance(self, step: float) -> None:
        self.now += step

    @precondition(lambda self: self.model.state is OPEN)
    @rule(short=st.booleans())
    def advance_to_deadline(self, short: bool) -> None:
        target = self.model.deadline - 0.001 if short else self.model.deadline
        self.now = max(self.now, target)

    @invariant()
    def matches_the_model(self) -> None:
        self.model.tick(self.now)
        assert self.breaker.statistics(self.now) == self.model.statistics()
        assert self.seen == self.model.transitions
        available = self.model.state is CLOSED or (
            self.model.state is HALF_OPEN and self.model.probe is None
        )
        assert self.breaker.available(self.now) == available

    @invariant()
    def at_most_one_probe_outstanding(self) -> None:
        live_probes = [e for e in self.model.outstanding if e.kind is Kind.PROBE and e.live]
        assert len(live_probes) <= 1
        assert live_probes == ([] if self.model.probe is None else [self.model.probe])
        if self.model.probe is not None:
            assert self.breaker.state(self.now) is HALF_OPEN

    @invariant()
    def cooldown_within_bounds(self) -> None:
        cooldown = self.breaker.statistics(self.now).cooldown_s
        assert self.model.base <= cooldown <= self.model.cap

    @invariant()
    def retry_after_agrees(self) -> None:
        state = self.breaker.state(self.now)
        retry = self.breaker.retry_after(self.now)
        if state is OPEN:
            assert 0 < retry <= self.model.cooldown
        elif state is HALF_OPEN and self.model.probe is not None:
            assert retry == self.model.cooldown
        else:
            assert retry == 0.0


BreakerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBreakerStateMachine = BreakerMachine.TestCase

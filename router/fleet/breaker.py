"""The per-worker circuit breaker: closed -> open -> half-open -> closed or open again.

A worker that accepts connections and answers `/health` can still fail every inference
request. Failover hides that from one request, but forgets it when the request ends; the
breaker is the memory that keeps the next request away. It is the router's private
opinion: it never writes worker status, and with `failure_threshold = 0` there is no
breaker at all (`make_breaker` returns None).

Pure decision logic: nothing here blocks or reads a clock. Every call takes `now` (the
caller passes `trio.current_time()`), so cooldowns, doubling and the single probe are
tested at full speed under a mock clock.

Open turns half-open by time alone, so no task has to wake up for it: the first call that
passes a `now` at or past the deadline applies the change and reports it, once per cycle.

Permits and stale verdicts
--------------------------
`acquire` hands out a `Permit` at the moment of dispatch; its verdict comes back through
`record` when the attempt ends. Many requests are in flight at once, so a verdict may
arrive after the breaker has moved on. Each permit carries the cycle it was granted in
(the trip count at that moment), and a verdict only ever speaks about that cycle:

- A plain permit granted while closed, whose verdict arrives after the breaker tripped, is
  ignored either way. Its fault is the same outage the trip already recorded, so it does
  not re-trip or extend the cooldown; its success does not close the breaker, because
  only a probe or a forced dispatch made while open says anything about the worker now.
- A forced permit (granted while open because every candidate was open) speaks for the
  outage it was granted in, until that outage ends.
- A probe speaks for its half-open window. While it is in flight it owns the verdict on
  that window: a forced fault then changes nothing (the probe will decide), whereas a
  forced success closes the breaker and the probe's own verdict becomes stale.

Each permit must be recorded exactly once.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

TransitionCallback = Callable[[str, "BreakerState", "BreakerState", float], None]


class BreakerState(enum.IntEnum):
    """The breaker's state; the values are the `router_worker_breaker_state` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Outcome(enum.Enum):
    """The verdict of one dispatch, as far as the breaker is concerned."""

    SUCCESS = "success"
    # Pre-first-byte only: transport error, timeout before headers, 5xx, unparseable
    # unary body.
    FAULT = "fault"
    # No verdict on the worker: 4xx (the request is bad), 429 (backpressure, which load
    # accounting handles), a client that left, a failure after bytes streamed.
    NEUTRAL = "neutral"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """`failure_threshold` consecutive faults open the breaker; 0 disables it.

    `cooldown_s` is the first wait before a probe; each failed probe doubles the wait,
    up to `max_cooldown_s`.
    """

    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        threshold = self.failure_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                f"breaker failure threshold must be an integer >= 0 (0 disables the breaker),"
                f" got {threshold!r}"
            )
        if not (_finite_seconds(self.cooldown_s) and self.cooldown_s > 0):
            raise ValueError(
                f"breaker cooldown must be a finite number of seconds > 0, got {self.cooldown_s!r}"
            )
        if not (_finite_seconds(self.max_cooldown_s) and self.max_cooldown_s >= self.cooldown_s):
            raise ValueError(
                f"breaker max cooldown must be a finite number of seconds >= the cooldown"
                f" ({self.cooldown_s!r}), got {self.max_cooldown_s!r}"
            )


def _finite_seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True, init=False)
class Permit:
    """Leave to dispatch one attempt to the worker; hand it back to `record`.

    `probe`: this attempt is the half-open probe. `forced`: dispatched while open because
    every candidate was open. `cycle`: the breaker's trip count when it was granted, which
    is how a verdict that arrives late is recognised as stale.
    """

    probe: bool
    forced: bool
    cycle: int = 0

    # Written out: compiled, the __init__ dataclass generates would run interpreted; the
    # compiled build makes each `object.__setattr__` a plain store (docs/performance.md,
    # "fifth round").
    def __init__(self, probe: bool, forced: bool, cycle: int = 0) -> None:
        object.__setattr__(self, "probe", probe)
        object.__setattr__(self, "forced", forced)
        object.__setattr__(self, "cycle", cycle)


@dataclass(frozen=True, slots=True)
class BreakerStatistics:
    """A snapshot for `/v1/workers` and the metrics.

    `next_probe_at` is when a probe is (or was) first admitted in the current open or
    half-open window; None while closed or while a probe is in flight.
    """

    state: BreakerState
    consecutive_faults: int
    cooldown_s: float
    next_probe_at: float | None
    trips: int
    probe_in_flight: bool


class CircuitBreaker:
    """One worker's breaker. Synchronous; every method takes `now` from the caller.

    `on_transition(name, old, new, now)` is called after every real state change, with
    the breaker already in its new state. Consecutive calls chain: each `old` is the
    previous call's `new`.
    """

    __slots__ = (
        "_cooldown",
        "_faults",
        "_name",
        "_on_transition",
        "_opened_at",
        "_probe_in_flight",
        "_settings",
        "_state",
        "_trips",
    )

    def __init__(
        self,
        settings: BreakerSettings,
        *,
        name: str = "",
        on_transition: TransitionCallback | None = None,
    ) -> None:
        if settings.failure_threshold == 0:
            raise ValueError(
                "a breaker with failure threshold 0 is disabled: use make_breaker, which"
                " returns None"
            )
        self._settings = settings
        self._name = name
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._faults = 0
        self._cooldown = settings.cooldown_s
        # Meaningful only while open or half-open.
        self._opened_at = 0.0
        self._probe_in_flight = False
        self._trips = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def settings(self) -> BreakerSettings:
        return self._settings

    def state(self, now: float) -> BreakerState:
        """The state at `now`. Open becomes half-open once `now >= opened_at + cooldown`."""
        if self._state is BreakerState.OPEN and now >= self._opened_at + self._cooldown:
            self._move(BreakerState.HALF_OPEN, now)
        return self._state

    def available(self, now: float) -> bool:
        """Whether the worker may be selected: closed, or half-open with the probe slot free."""
        state = self.state(now)
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probe_in_flight
        )

    def acquire(self, now: float, *, force: bool = False) -> Permit | None:
        """Decide whether one attempt may go to this worker now; call it at dispatch time.

        Closed: a plain permit. Half-open with the slot free: the slot is taken and the
        permit is the probe. Otherwise None, unless `force` (every candidate is open and
        the router dispatches anyway): then a forced permit, which leaves the probe slot
        alone.
        """
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return Permit(probe=False, forced=False, cycle=self._trips)
        if state is BreakerState.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return Permit(probe=True, forced=False, cycle=self._trips)
        if force:
            return Permit(probe=False, forced=True, cycle=self._trips)
        return None

    def record(self, permit: Permit, outcome: Outcome, now: float) -> None:
        """Apply the verdict of the attempt `permit` allowed.

        Closed: a fault counts towards the threshold and trips the breaker when it is
        reached; a success resets the count. A probe's success closes the breaker and
        resets the cooldown; its fault re-opens it with the cooldown doubled (capped); a
        neutral probe frees the slot and leaves it half-open. A forced success closes the
        breaker; a forced fault re-arms the open timer from `now` without doubling. A
        neutral outcome never changes anything else. A verdict from an earlier cycle is
        ignored (see the module docstring).
        """
        self.state(now)
        if permit.cycle != self._trips:
            return
        if permit.probe:
            self._record_probe(outcome, now)
        elif permit.forced:
            self._record_forced(outcome, now)
        else:
            self._record_plain(outcome, now)

    def retry_after(self, now: float) -> float:
        """Seconds until a probe would be admitted; 0 when the worker is available now.

        While a probe is in flight nobody knows; the current cooldown is the estimate.
        """
        state = self.state(now)
        if state is BreakerState.OPEN:
            # Clamped: (t + c) - t can round to a hair above c, and a caller rounding up to
            # whole seconds for `Retry-After` would then add a second.
            return min(self._opened_at + self._cooldown - now, self._cooldown)
        if state is BreakerState.HALF_OPEN and self._probe_in_flight:
            return self._cooldown
        return 0.0

    def statistics(self, now: float) -> BreakerStatistics:
        state = self.state(now)
        next_probe_at: float | None = None
        if state is not BreakerState.CLOSED and not self._probe_in_flight:
            next_probe_at = self._opened_at + self._cooldown
        return BreakerStatistics(
            state=state,
            consecutive_faults=self._faults,
            cooldown_s=self._cooldown,
            next_probe_at=next_probe_at,
            trips=self._trips,
            probe_in_flight=self._probe_in_flight,
        )

    def _record_plain(self, outcome: Outcome, now: float) -> None:
        # Same cycle means no trip since the grant, so the breaker is still closed.
        if outcome is Outcome.SUCCESS:
            self._faults = 0
        elif outcome is Outcome.FAULT:
            self._faults += 1
            if self._faults >= self._settings.failure_threshold:
                self._trips += 1
                self._opened_at = now
                self._move(BreakerState.OPEN, now)

    def _record_probe(self, outcome: Outcome, now: float) -> None:
        if not self._probe_in_flight:
            # A forced success closed the window this probe was sent into.
            return
        if outcome is Outcome.SUCCESS:
            self._close(now)
        elif outcome is Outcome.FAULT:
            self._probe_in_flight = False
            self._cooldown = min(self._cooldown * 2, self._settings.max_cooldown_s)
            self._opened_at = now
            self._move(BreakerState.OPEN, now)
        else:
            self._probe_in_flight = False

    def _record_forced(self, outcome: Outcome, now: float) -> None:
        if self._state is BreakerState.CLOSED:
            # The outage this permit was granted in is over.
            return
        if outcome is Outcome.SUCCESS:
            self._close(now)
        elif outcome is Outcome.FAULT and not self._probe_in_flight:
            # Forced traffic is not a probe: the evidence is fresh, so the wait starts
            # again, but it does not earn a longer one.
            self._opened_at = now
            if self._state is BreakerState.HALF_OPEN:
                self._move(BreakerState.OPEN, now)

    def _close(self, now: float) -> None:
        self._faults = 0
        self._cooldown = self._settings.cooldown_s
        self._probe_in_flight = False
        self._move(BreakerState.CLOSED, now)

    def _move(self, new: BreakerState, now: float) -> None:
        old, self._state = self._state, new
        if self._on_transition is not None:
            self._on_transition(self._name, old, new, now)


def make_breaker(
    settings: BreakerSettings, name: str, on_transition: TransitionCallback | None = None
) -> CircuitBreaker | None:
    """A breaker for worker `name`, or None when the breaker is disabled (threshold 0)."""
    if settings.failure_threshold == 0:
        return None
    return CircuitBreaker(settings, name=name, on_transition=on_transition)

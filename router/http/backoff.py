"""Retry delays for talking to etcd: short after one failure, long while it stays down."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Exponential delays: `initial_s`, doubling with each consecutive failure, capped at
    `max_s`; `reset()` after a success brings the next delay back to `initial_s`.

    Pure bookkeeping: the caller sleeps.
    """

    initial_s: float = 0.1
    max_s: float = 5.0
    _next_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(
                f"need 0 < initial_s <= max_s, got initial_s={self.initial_s} max_s={self.max_s}"
            )
        self._next_s = self.initial_s

    def failure(self) -> float:
        """The delay before the next attempt, after one more failure in a row."""
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next_s = self.initial_s

"""The load a policy reads: the engine's own count, plus what this process sent that the
engine cannot have counted yet.

Two sources, each blind where the other sees. The router's own in-flight count is instant
but knows nothing of other router processes or replicas; the engine's gauges (running
and waiting requests) count every sender alike but lag: a request is counted only once
the engine's front end has tokenized it and its scheduler has taken it in, and a polled
reading is as old as its interval. So the figure is

    load = others + this process's requests in flight now

where `others` is the engine's count at its last reading minus the requests of this
process it held then. Which of ours it held is decided by time: a request this process
sent within `window_s` before the reading was taken is presumed not counted yet (the
engine's intake lag), any earlier one still in flight is presumed counted; one that has
ended by then is in neither count. A request of ours that ends, or a new one sent, moves
the figure at once; only other senders' work waits for the next reading. A reading that is missing, stale or garbage leaves `others`
unknown (None), and the figure is then this process's own count: unknown is never zero,
and never a guess.

Pure and synchronous: times come from the caller (trio's clock in the router).
"""

from __future__ import annotations

from collections import deque
from typing import Final

MAX_RECENT_DISPATCHES: Final = 4096
"""Send times of requests still in flight kept per view, to tell which a reading can have
counted. Only those within the window before a reading matter (older ones are dropped at
each reading); past this many (a burst beyond 4,096 requests within one window), the
oldest are presumed counted."""


class EngineShare:
    """One engine view's load beyond this process (a worker, or one DP rank of it).

    `others` is None while unknown: before the first reading, and whenever the reader
    lost the engine (a failed or late read, a silent stream, garbage).
    """

    __slots__ = ("_recent", "others", "read_at")

    def __init__(self) -> None:
        self.others: float | None = None
        self.read_at: float | None = None
        """When the reading behind `others` was taken (the caller's clock)."""
        self._recent: deque[float] = deque(maxlen=MAX_RECENT_DISPATCHES)

    def dispatched(self, now: float) -> None:
        """This process sent one request to the view at `now`."""
        self._recent.append(now)

    def ended(self, sent_at: float) -> None:
        """A request of this process sent at `sent_at` ended: it is in no reading to come.
        Found from the newest end, where requests of the window are (O(those))."""
        recent = self._recent
        if not recent or sent_at < recent[0]:
            return  # older than the window: presumed counted, and dropped already
        for position in range(len(recent) - 1, -1, -1):
            if recent[position] == sent_at:
                del recent[position]
                return

    def observe(self, total: float, taken_at: float, own_inflight: int, window_s: float) -> None:
        """The engine held `total` requests (running + waiting) when the reading was taken,
        at `taken_at`; this process has `own_inflight` requests on the view now.

        Ours still in flight and sent after `taken_at - window_s` are presumed not counted
        in `total`, the rest of ours still in flight presumed counted; the engine's surplus over those is other
        senders' work. Never below zero: a reading that lags our own completions is not
        read as negative work elsewhere.
        """
        counted_own = self.counted_own(taken_at, own_inflight, window_s)
        self.others = max(0.0, total - counted_own)
        self.read_at = taken_at

    def counted_own(self, taken_at: float, own_inflight: int, window_s: float) -> int:
        """How many of this process's `own_inflight` requests a reading taken at `taken_at`
        must have counted: those sent before `taken_at - window_s`. Forgets the send times
        older than that (no later reading needs them)."""
        cutoff = taken_at - window_s
        recent = self._recent
        while recent and recent[0] < cutoff:
            recent.popleft()
        return max(0, own_inflight - len(recent))

    def kept_dispatches(self) -> int:
        """Dispatch times held to judge the next reading (bounded)."""
        return len(self._recent)

    def lose(self) -> None:
        """The reading is gone (the engine did not answer, answered garbage, went silent):
        until the next good one, the view's load is this process's own count."""
        self.others = None
        self.read_at = None


def figure(others: float | None, own_inflight: int) -> float:
    """The load a policy reads: `others` plus this process's own, or only its own while
    `others` is unknown."""
    return float(own_inflight) if others is None else others + own_inflight

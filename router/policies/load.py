"""The policies that read the router's own load accounting: `least_load` (fewest in flight)
and `power_of_two` (two at random, the less loaded of them)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.fleet.registry import Worker
from router.policies.policy import PolicyKey, _StateKey


class LeastLoad:
    """The candidate with the fewest requests in flight through this router.

    The scan starts one place further on each time, so equal loads (an idle fleet, a
    burst arriving before any request finishes) spread instead of piling on the first.
    """

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start: dict[_StateKey, int] = {}

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        count = len(candidates)
        state_key = (key.model, key.role)
        start = self._start.get(state_key, 0) % count
        self._start[state_key] = (start + 1) % count
        best = candidates[start]
        for offset in range(1, count):
            worker = candidates[(start + offset) % count]
            if worker.inflight < best.inflight:
                best = worker
        return best


class PowerOfTwo:
    """Two distinct random candidates; the less loaded of them (the first on a tie)."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        count = len(candidates)
        if count == 1:
            return candidates[0]
        first = self._rng.randrange(count)
        second = self._rng.randrange(count - 1)
        if second >= first:
            second += 1
        a, b = candidates[first], candidates[second]
        return b if b.inflight < a.inflight else a

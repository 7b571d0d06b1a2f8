"""The policies that look at the candidates only: `round_robin` and `random`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Final

from router.fleet.registry import Worker
from router.policies.policy import PolicyKey, _StateKey

_COUNTER_MASK: Final = (1 << 62) - 1


class RoundRobin:
    """Each (model, role) walks its candidates in turn."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next: dict[_StateKey, int] = {}

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        state_key = (key.model, key.role)
        turn = self._next.get(state_key, 0)
        # A plain counter, not one reduced modulo this call's list: a failover pick among
        # the one remaining worker must not reset the rotation the next request starts from.
        self._next[state_key] = (turn + 1) & _COUNTER_MASK
        return candidates[turn % len(candidates)]


class RandomChoice:
    """A uniformly random candidate."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        return candidates[self._rng.randrange(len(candidates))]

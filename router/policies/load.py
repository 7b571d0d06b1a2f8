"""The policies that read load (`Worker.load`: the engine's own count plus what this
process sent that it cannot have counted yet, or this process's own count while the
engine's is unknown; `router.fleet.load`): `least_load` (the least loaded) and
`power_of_two` (two at random, the less loaded of them). A request for a LoRA adapter
adds to each candidate's load what the adapter costs there
(`router.policies.adapter_affinity`)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.fleet.registry import Worker
from router.policies.adapter_affinity import AdapterAffinitySettings, adapter_cost
from router.policies.policy import PolicyKey, _StateKey
from router.policies.spread import NearTies, deterministic


class LeastLoad:
    """The least loaded candidate.

    The scan starts one place further on each time, so equal loads (an idle fleet, a
    burst arriving before any request finishes) spread instead of piling on the first;
    with a spread margin, candidates within it of the least loaded are drawn at random
    (`router.policies.spread`), so replicas reading the same loads spread too.
    """

    __slots__ = ("_start", "adapters", "ties")

    def __init__(
        self, ties: NearTies | None = None, adapters: AdapterAffinitySettings | None = None
    ) -> None:
        self._start: dict[_StateKey, int] = {}
        self.ties = ties or deterministic()
        self.adapters = adapters or AdapterAffinitySettings()

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        count = len(candidates)
        state_key = (key.model, key.role)
        start = self._start.get(state_key, 0) % count
        self._start[state_key] = (start + 1) % count
        adapter = key.adapter
        if adapter is None:
            scored = [(worker.load, worker) for worker in candidates]
        else:
            costs = self.adapters
            scored = [
                (worker.load + adapter_cost(worker, adapter, costs), worker)
                for worker in candidates
            ]
        best = start
        for offset in range(1, count):
            index = (start + offset) % count
            if scored[index][0] < scored[best][0]:
                best = index
        return self.ties.choose(scored, best)


class PowerOfTwo:
    """Two distinct random candidates; the less loaded of them (the first on a tie)."""

    __slots__ = ("_rng", "adapters")

    def __init__(self, rng: random.Random, adapters: AdapterAffinitySettings | None = None) -> None:
        self._rng = rng
        self.adapters = adapters or AdapterAffinitySettings()

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        count = len(candidates)
        if count == 1:
            return candidates[0]
        first = self._rng.randrange(count)
        second = self._rng.randrange(count - 1)
        if second >= first:
            second += 1
        a, b = candidates[first], candidates[second]
        adapter = key.adapter
        if adapter is None:
            return b if b.load < a.load else a
        cost_a = a.load + adapter_cost(a, adapter, self.adapters)
        cost_b = b.load + adapter_cost(b, adapter, self.adapters)
        return b if cost_b < cost_a else a

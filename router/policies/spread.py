"""Near-ties broken at random, so router replicas that read the same loads do not herd.

Every router process and replica reads the same engine loads and the same KV-cache
events. A deterministic choice over the same snapshot is then the same choice in every
replica: each sends its next request to the one engine that looked idlest, and that
engine takes a burst from all of them at once. Among candidates whose cost lies within
`margin` of the best, `NearTies` picks uniformly at random with the process's own
generator, so replicas spread over the engines that cost about the same. With
`margin` 0 the choice is today's deterministic one (the first best from a rotating
start), and no random number is drawn.

The margin is in the policies' load unit, requests in flight: the benchmark behind its
default is in docs/policies.md ("Replicas").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SpreadSettings:
    margin: float = 0.0
    """Candidates costing at most this much more than the best (in requests in flight)
    are equally good: one of them is drawn at random. 0 (here; the router's flag has its
    own default): the deterministic best."""
    seed: int | None = None
    """The process's generator seed; None draws one from the OS, so replicas differ."""

    def __post_init__(self) -> None:
        if not self.margin >= 0:
            raise ValueError(f"the spread margin must be 0 or more, not {self.margin!r}")


class NearTies:
    """Picks among near-best candidates; `drawn` counts the random draws it made."""

    __slots__ = ("drawn", "margin", "rng")

    def __init__(self, margin: float, rng: random.Random) -> None:
        self.margin = margin
        self.rng = rng
        self.drawn = 0

    def choose(self, scored: Sequence[tuple[float, T]], best: int) -> T:
        """One of `scored` (cost, candidate) pairs: `scored[best]` (the caller's
        deterministic choice, which is also the lowest cost) when the margin is 0 or no
        other lies within it, else a random one of those within `margin` of it."""
        if self.margin <= 0:
            return scored[best][1]
        bound = scored[best][0] + self.margin
        near = [candidate for cost, candidate in scored if cost <= bound]
        if len(near) == 1:
            return scored[best][1]
        self.drawn += 1
        return near[self.rng.randrange(len(near))]


def deterministic() -> NearTies:
    """No spread: the policies' deterministic choice (tests and single-process setups
    that want exact placements)."""
    return NearTies(0.0, random.Random(0))

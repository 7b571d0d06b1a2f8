"""The policies by their configuration names (`--policy`, `--prefill-policy`, ...)."""

from __future__ import annotations

import random

from router.policies.cache_aware import CacheAware, CacheAwareSettings
from router.policies.consistent_hash import ConsistentHash
from router.policies.load import LeastLoad, PowerOfTwo
from router.policies.policy import Policy
from router.policies.simple import RandomChoice, RoundRobin

POLICY_NAMES = (
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
)


def make_policy(
    name: str, *, rng: random.Random | None = None, cache: CacheAwareSettings | None = None
) -> Policy:
    """A fresh policy (with its own state) by its configuration name."""
    chooser = rng if rng is not None else random.Random()
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(chooser)
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(chooser)
    if name == "consistent_hash":
        return ConsistentHash()
    if name == "cache_aware":
        return CacheAware(cache if cache is not None else CacheAwareSettings())
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")

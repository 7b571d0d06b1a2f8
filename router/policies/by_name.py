"""The policies by their configuration names (`--policy`, `--prefill-policy`, ...)."""

from __future__ import annotations

import random
from typing import Final

from router.engines.kv_events.fleet_views import KvIndexes
from router.policies.adapter_affinity import AdapterAffinitySettings
from router.policies.cache_aware import CacheAware, CacheAwareSettings
from router.policies.consistent_hash import ConsistentHash
from router.policies.kv_aware import KvAware, KvAwareSettings, KvPolicyInputs
from router.policies.load import LeastLoad, PowerOfTwo
from router.policies.policy import Policy
from router.policies.simple import RandomChoice, RoundRobin
from router.policies.spread import NearTies

POLICY_NAMES: Final = (
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
    "kv_aware",
)


def make_policy(
    name: str,
    *,
    rng: random.Random | None = None,
    cache: CacheAwareSettings | None = None,
    kv: KvPolicyInputs | None = None,
    ties: NearTies | None = None,
    adapters: AdapterAffinitySettings | None = None,
) -> Policy:
    """A fresh policy (with its own state) by its configuration name. `kv_aware` reads
    the indexes of `kv` (without them, an empty index of its own: load only);
    `least_load` and `kv_aware` break near-ties with `ties` (default: none,
    deterministic); the load-reading ones weigh a LoRA adapter's slots by `adapters`
    (default: `AdapterAffinitySettings()`)."""
    chooser = rng if rng is not None else random.Random()
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(chooser)
    if name == "least_load":
        return LeastLoad(ties, adapters)
    if name == "power_of_two":
        return PowerOfTwo(chooser, adapters)
    if name == "consistent_hash":
        return ConsistentHash()
    if name == "cache_aware":
        return CacheAware(cache if cache is not None else CacheAwareSettings())
    if name == "kv_aware":
        if kv is None:
            kv = KvPolicyInputs(KvAwareSettings(), KvIndexes(), lambda: 0.0)
        return KvAware(kv.settings, kv.indexes, kv.clock, kv.tokenizer, ties, kv.local, adapters)
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")

"""Routing policies: pure, synchronous choices among a leg's candidates, the routing keys they read, and the prefix tree behind cache-aware routing."""

from router.policies.by_name import POLICY_NAMES, make_policy
from router.policies.cache_aware import CacheAware, CacheAwareCollector, CacheAwareSettings
from router.policies.kv_aware import KvAware, KvAwareSettings, KvPolicyInputs
from router.policies.kv_aware_metrics import KvAwareCollector
from router.policies.policy import Policy, PolicyKey, pick_excluding
from router.policies.routing_keys import routing_key, routing_text

__all__ = [
    "POLICY_NAMES",
    "CacheAware",
    "CacheAwareCollector",
    "CacheAwareSettings",
    "KvAware",
    "KvAwareCollector",
    "KvAwareSettings",
    "KvPolicyInputs",
    "Policy",
    "PolicyKey",
    "make_policy",
    "pick_excluding",
    "routing_key",
    "routing_text",
]

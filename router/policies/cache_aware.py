"""`cache_aware`: send a request where its prefix probably sits in KV cache, unless the
fleet is out of balance.

The SGLang model gateway's policy, with its flag names and defaults:

1. Load first. Over the candidates' loads (`Worker.load`: the engine's count plus what
   this process sent that it cannot have counted yet, else this process's own), when `max - min >
   balance_abs_threshold` and `max > min * balance_rel_threshold`, the least loaded
   candidate takes the request.
2. Otherwise the request's routing text is matched against the model's prefix tree: the
   candidate with the longest common prefix wins when that prefix is at least
   `cache_threshold` of the text; below it, the candidate whose tree holds the fewest
   characters (the one with the most room) wins.
3. Either way the text is then inserted under the chosen worker.

Matches of a block or more are compared in whole blocks of `MATCH_BLOCK_CHARS` characters
(about 16 tokens, a KV-cache page of common engines): a few characters more in common save
no prefill, so they do not decide. Equal matches go to the lower load, then to the smaller tree, then to the
earlier candidate: a prefix every worker holds (a shared system prompt, followed by user
text that happens to share a first word) does not pull every new conversation to the
worker holding the most conversations. Among equally least loaded candidates the load
check prefers the longest match, then the smaller tree. The threshold is checked on the
exact match. One tree per (model, role),
each bounded to `max_tree_size` characters (see `router.policies.prefix_tree`). Candidates are
already filtered (draining, unhealthy, breaker-open, tried), as for every policy; a worker
that leaves the fleet leaves every tree through `forget_worker`.

Pure and synchronous: no clock, no I/O; recency in the trees is a logical tick.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.fleet.records import Role
from router.fleet.registry import Worker
from router.policies.prefix_tree import PrefixTree

# Characters per compared block: 16 tokens at the ~4 characters per token of English text.
MATCH_BLOCK_CHARS: Final = 64


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26


class RequestKey(Protocol):
    """What the policy reads of a request's `PolicyKey`."""

    @property
    def model(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def text(self) -> str | None: ...


class CacheAware:
    """The cache-aware policy; `statistics()` reports its trees and decisions."""

    __slots__ = ("_trees", "by_balance", "by_match", "by_room", "settings")

    def __init__(self, settings: CacheAwareSettings) -> None:
        self.settings = settings
        self._trees: dict[tuple[str, Role], PrefixTree] = {}
        self.by_balance = 0
        self.by_match = 0
        self.by_room = 0

    def tree(self, model: str, role: Role) -> PrefixTree | None:
        return self._trees.get((model, role))

    def pick(self, key: RequestKey, candidates: Sequence[Worker]) -> Worker:
        text = key.text or ""
        tree = self._trees.get((key.model, key.role))
        if tree is None:
            tree = self._trees[(key.model, key.role)] = PrefixTree(self.settings.max_tree_size)
        chosen = self._choose(tree, text, candidates)
        tree.insert(text, chosen.id)
        return chosen

    def worker_left(self, worker: Worker) -> None:
        """The fleet's departure notice (`router.fleet.registry.FleetListener`)."""
        self.forget_worker(worker.id)

    def url_dropped(self, url: str) -> None:
        """Nothing here is kept per URL: a worker's prefixes go by its id (`worker_left`)."""

    def forget_worker(self, worker_id: str) -> None:
        """A worker left the fleet: its prefixes are forgotten in every tree."""
        for state_key, tree in list(self._trees.items()):
            tree.forget(worker_id)
            if not tree.tenants():
                del self._trees[state_key]

    def statistics(self) -> dict[str, int]:
        return {
            "trees": len(self._trees),
            "tree_chars": sum(tree.chars for tree in self._trees.values()),
            "tree_nodes": sum(tree.nodes for tree in self._trees.values()),
            "evicted_chars": sum(tree.evicted_chars for tree in self._trees.values()),
            "picks_by_balance": self.by_balance,
            "picks_by_match": self.by_match,
            "picks_by_room": self.by_room,
        }

    def _choose(self, tree: PrefixTree, text: str, candidates: Sequence[Worker]) -> Worker:
        settings = self.settings
        low = min(worker.load for worker in candidates)
        high = max(worker.load for worker in candidates)
        matched = tree.match(text, [worker.id for worker in candidates]) if text else {}
        if (
            high - low > settings.balance_abs_threshold
            and high > low * settings.balance_rel_threshold
        ):
            self.by_balance += 1
            # Among the least loaded, the one holding the longest prefix keeps what it can.
            return min(
                candidates,
                key=lambda worker: (
                    worker.load,
                    -(matched.get(worker.id, 0) // MATCH_BLOCK_CHARS),
                    tree.tenant_size(worker.id),
                ),
            )
        if text:
            longest = max(matched.values())
            if longest / len(text) >= settings.cache_threshold:
                # Under one block, exact characters decide (a short prompt still sticks).
                unit = MATCH_BLOCK_CHARS if longest >= MATCH_BLOCK_CHARS else 1
                best = min(
                    (
                        worker
                        for worker in candidates
                        if matched[worker.id] // unit == longest // unit
                    ),
                    key=lambda worker: (worker.load, tree.tenant_size(worker.id)),
                )
                self.by_match += 1
                return best
        self.by_room += 1
        return min(candidates, key=lambda worker: (tree.tenant_size(worker.id), worker.load))


class CacheAwareCollector(Collector):
    """One series per role whose policy is `cache_aware`."""

    def __init__(self, policies: Mapping[Role, CacheAware]) -> None:
        self._policies = policies

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        chars = GaugeMetricFamily(
            "router_cache_aware_tree_chars",
            "Characters held by the cache_aware prefix trees (bounded by --max-tree-size per model)",
            labels=["role"],
        )
        nodes = GaugeMetricFamily(
            "router_cache_aware_tree_nodes",
            "Nodes of the cache_aware prefix trees",
            labels=["role"],
        )
        evicted = CounterMetricFamily(
            "router_cache_aware_evicted_chars",
            "Characters evicted from the cache_aware prefix trees",
            labels=["role"],
        )
        picks = CounterMetricFamily(
            "router_cache_aware_picks",
            "cache_aware picks by reason: balance (load check), match (prefix at or above the threshold), room (smallest tree)",
            labels=["role", "reason"],
        )
        for role, policy in self._policies.items():
            stats = policy.statistics()
            chars.add_metric([role.value], stats["tree_chars"])
            nodes.add_metric([role.value], stats["tree_nodes"])
            evicted.add_metric([role.value], stats["evicted_chars"])
            for reason in ("balance", "match", "room"):
                picks.add_metric([role.value, reason], stats[f"picks_by_{reason}"])
        yield chars
        yield nodes
        yield evicted
        yield picks

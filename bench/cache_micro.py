"""In-process figures of the cache-aware policy: microseconds per pick-and-insert against a
tree holding 10^6 characters, and the tree's memory after 10^5 distinct prompts.

CPU time (`time.process_time`), so a busy neighbour slows the figure less than it would
a wall-clock one; it is still noisy on a shared machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Worker
from router.policies.cache_aware import CacheAware, CacheAwareSettings
from router.policies.policy import PolicyKey
from router.policies.simple import RoundRobin

PROMPT_CHARS = 4096
TREE_CHARS = 1_000_000
WORKERS = 4


@dataclass(frozen=True, slots=True)
class MicroResult:
    picks: int
    cache_aware_us: float
    round_robin_us: float
    tree_chars: int
    distinct_prompts: int
    budget_chars: int
    peak_chars: int
    evicted_chars: int
    fill_s: float


def _workers() -> list[Worker]:
    return [
        Worker(record=WorkerRecord(id=f"w{i}", url=f"http://w{i}.test", models=("m",)))
        for i in range(WORKERS)
    ]


def _prompt(index: int, shared: str) -> str:
    # Half of the prompts extend a shared prefix (a conversation's next turn), half are new.
    tail = os.urandom(PROMPT_CHARS // 2).hex()
    return (shared + tail)[:PROMPT_CHARS] if index % 2 else tail[: PROMPT_CHARS - 1] + "x"


def pick_and_insert(picks: int = 2000) -> tuple[float, float, int]:
    """(µs per cache_aware pick-and-insert, µs per round_robin pick, tree characters).

    The tree is filled to its budget of 10^6 characters first and stays there: the timed
    picks include the evictions that keep it at the budget, as in a long-running router.
    """
    workers = _workers()
    policy = CacheAware(CacheAwareSettings(max_tree_size=TREE_CHARS))
    filled = 0
    while filled < 2 * TREE_CHARS:
        policy.pick(PolicyKey("m", Role.MIXED, text=os.urandom(PROMPT_CHARS // 2).hex()), workers)
        filled += PROMPT_CHARS
    tree = policy.tree("m", Role.MIXED)
    assert tree is not None
    shared = os.urandom(PROMPT_CHARS // 4).hex()
    keys = [PolicyKey("m", Role.MIXED, text=_prompt(i, shared)) for i in range(picks)]
    started = time.process_time()
    for key in keys:
        policy.pick(key, workers)
    cache_us = (time.process_time() - started) / picks * 1e6
    round_robin = RoundRobin()
    plain = PolicyKey("m", Role.MIXED)
    started = time.process_time()
    for _ in range(picks):
        round_robin.pick(plain, workers)
    rr_us = (time.process_time() - started) / picks * 1e6
    return cache_us, rr_us, tree.chars


def memory_bound(prompts: int = 100_000, budget: int = 2**26) -> tuple[int, int, int, float]:
    """(peak characters, characters evicted, budget, seconds) after `prompts` distinct 4 KiB prompts."""
    workers = _workers()
    policy = CacheAware(CacheAwareSettings(max_tree_size=budget))
    peak = 0
    started = time.process_time()
    for index in range(prompts):
        text = f"{index:08d}" + os.urandom(PROMPT_CHARS // 2).hex()[: PROMPT_CHARS - 8]
        policy.pick(PolicyKey("m", Role.MIXED, text=text), workers)
        tree = policy.tree("m", Role.MIXED)
        peak = max(peak, tree.chars if tree is not None else 0)  # after every insert
    stats = policy.statistics()
    return peak, stats["evicted_chars"], budget, time.process_time() - started


def run(picks: int = 2000, prompts: int = 100_000) -> MicroResult:
    cache_us, rr_us, tree_chars = pick_and_insert(picks)
    peak, evicted, budget, fill_s = memory_bound(prompts)
    return MicroResult(picks, cache_us, rr_us, tree_chars, prompts, budget, peak, evicted, fill_s)

"""The index against a model of two engines' caches: whatever the engines store, evict
and clear, with their own hash seeds, the index reports each one's cached prefix."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvIndex, ViewId

BS = 2
ALPHABET = (1, 2)
DEPTH = 3
PATHS = [p for d in range(1, DEPTH + 1) for p in itertools.product(ALPHABET, repeat=d)]
VIEWS: list[ViewId] = [("a", None), ("b", 0)]


class Engine:
    """A prefix cache as vLLM keeps one: full blocks by hash, the hash chained over the
    prefix with this engine's seed, a store event for the blocks a request newly caches.
    The lookup stops at the first miss, so a request whose parent block was evicted
    caches its later blocks again: two physical copies of one hash, each evicted alone."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cached: Counter[tuple[int, ...]] = Counter()

    def hash(self, path: tuple[int, ...]) -> int | bytes:
        value = hash((self.seed, path)) & (2**64 - 1)
        return value if self.seed % 2 else value.to_bytes(8, "big")

    def run(self, path: tuple[int, ...]) -> BlockStored | None:
        hit = 0
        while hit < len(path) and path[: hit + 1] in self.cached:
            hit += 1
        if hit == len(path):
            return None
        new = [path[: i + 1] for i in range(hit, len(path))]
        self.cached.update(new)  # one more copy of each
        return BlockStored(
            block_hashes=[self.hash(p) for p in new],
            parent_block_hash=None if hit == 0 else self.hash(path[:hit]),
            token_ids=[t for p in new for t in [p[-1]] * BS],
            block_size=BS,
            medium="GPU",
        )

    def prefix(self, path: tuple[int, ...]) -> int:
        n = 0
        while n < len(path) and path[: n + 1] in self.cached:
            n += 1
        return n


actions = st.lists(
    st.tuples(
        st.sampled_from(["run", "run", "run", "evict", "clear"]),
        st.integers(0, len(VIEWS) - 1),
        st.integers(0, len(PATHS) - 1),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
# A parent evicted, its path run again (a second copy of the child), one copy evicted.
@example(actions=[("run", 0, 2), ("evict", 0, 0), ("run", 0, 2), ("evict", 0, 1)], seeds=(1, 2))
@given(actions=actions, seeds=st.tuples(st.integers(), st.integers()))
def test_index_matches_the_engines_caches(
    actions: list[tuple[str, int, int]], seeds: tuple[int, int]
) -> None:
    engines = [Engine(seeds[0]), Engine(seeds[1] ^ 1 if seeds[1] == seeds[0] else seeds[1])]
    index = KvIndex()
    for view in VIEWS:
        index.apply(view, [AllBlocksCleared()])
    for action, which, choice in actions:
        engine, view = engines[which], VIEWS[which]
        if action == "run":
            event = engine.run(PATHS[choice])
            if event is not None:
                index.apply(view, [event])
        elif action == "evict" and engine.cached:
            # Any unreferenced block can go, a parent before its children included.
            victim = sorted(engine.cached)[choice % len(engine.cached)]
            engine.cached[victim] -= 1
            if not engine.cached[victim]:
                del engine.cached[victim]
            index.apply(view, [BlockRemoved(block_hashes=[engine.hash(victim)], medium="GPU")])
        elif action == "clear":
            engine.cached.clear()
            index.apply(view, [AllBlocksCleared()])
    if index.block_size is None:
        return
    for path in PATHS:
        tokens = [t for block in path for t in [block] * BS]
        result = index.match(index.block_keys(tokens), now=0.0)
        assert result.unknown == frozenset()
        assert result.runs == {v: e.prefix(path) for v, e in zip(VIEWS, engines, strict=True)}

"""The prefix tree against a brute-force reference, and its memory bound."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policies.prefix_tree import LOW_WATER, PrefixTree

TENANTS = ("w1", "w2", "w3")
# A small alphabet makes shared prefixes, splits and partial edges common.
texts = st.text(alphabet="abc\u00e9\U0001f600", max_size=12)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), texts, st.sampled_from(TENANTS)),
        st.tuples(st.just("forget"), st.just(""), st.sampled_from(TENANTS)),
    ),
    max_size=40,
)


def common_prefix(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


class Reference:
    """Every stored text per tenant; matching is the longest common prefix over all of them."""

    def __init__(self) -> None:
        self.stored: dict[str, set[str]] = {}

    def insert(self, text: str, tenant: str) -> None:
        self.stored.setdefault(tenant, set()).add(text)

    def forget(self, tenant: str) -> None:
        self.stored.pop(tenant, None)

    def match(self, text: str, tenant: str) -> int:
        return max(
            (common_prefix(text, stored) for stored in self.stored.get(tenant, ())), default=0
        )

    def distinct_chars(self) -> int:
        """Characters of the smallest radix tree holding every stored text: distinct non-empty prefixes."""
        prefixes = {
            t[:i] for texts in self.stored.values() for t in texts for i in range(1, len(t) + 1)
        }
        return len(prefixes)


@settings(max_examples=300, deadline=None)
@given(operations, st.lists(texts, min_size=1, max_size=5))
def test_match_equals_the_longest_common_prefix_over_every_stored_text(
    ops: list[tuple[str, str, str]], queries: list[str]
) -> None:
    tree = PrefixTree(max_chars=10_000)
    reference = Reference()
    for op, text, tenant in ops:
        if op == "insert":
            tree.insert(text, tenant)
            reference.insert(text, tenant)
        else:
            tree.forget(tenant)
            reference.forget(tenant)
    for query in queries + [text for _, text, _ in ops]:
        found = tree.match(query, TENANTS)
        assert found == {tenant: reference.match(query, tenant) for tenant in TENANTS}, query
    # Memory is exactly the distinct prefixes still remembered: forget leaves nothing behind.
    assert tree.chars == reference.distinct_chars()
    for tenant in TENANTS:
        mine = {t[:i] for t in reference.stored.get(tenant, ()) for i in range(1, len(t) + 1)}
        assert tree.tenant_size(tenant) == len(mine)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(texts, st.sampled_from(TENANTS)), max_size=60), st.integers(1, 30))
def test_the_budget_holds_after_every_insert_and_matches_never_overstate(
    inserts: list[tuple[str, str]], budget: int
) -> None:
    tree = PrefixTree(max_chars=budget)
    reference = Reference()
    for text, tenant in inserts:
        tree.insert(text, tenant)
        reference.insert(text, tenant)
        assert tree.chars <= budget
        assert sum(tree.tenant_size(t) for t in TENANTS) >= tree.chars
        # Eviction only forgets: a match is never longer than the reference says.
        for query, _ in inserts[-3:]:
            found = tree.match(query, TENANTS)
            for name in TENANTS:
                assert found[name] <= reference.match(query, name)


def test_the_most_recent_text_survives_eviction_and_the_oldest_goes_first() -> None:
    tree = PrefixTree(max_chars=100)
    tree.insert("a" * 40, "w1")
    tree.insert("b" * 40, "w2")
    tree.insert("a" * 40, "w1")  # touched again: now newer than the b's
    tree.insert("c" * 40, "w3")  # 120 > 100: evict to 90
    assert tree.chars <= 100 * LOW_WATER
    found = tree.match("a" * 40 + "c" * 40, TENANTS)
    assert found["w1"] == 40
    assert tree.match("b" * 40, TENANTS)["w2"] == 0
    assert tree.match("c" * 40, TENANTS)["w3"] == 40
    assert tree.evicted_chars == 40
    assert "w2" not in tree.tenants()


def test_a_text_longer_than_the_budget_is_cut_to_it() -> None:
    tree = PrefixTree(max_chars=50)
    tree.insert("x" * 1000, "w1")
    assert tree.chars <= 50


def test_forget_drops_only_that_tenant() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("system prompt, then user one", "w1")
    tree.insert("system prompt, then user two", "w2")
    tree.forget("w1")
    assert tree.match("system prompt, then user one", TENANTS) == {"w1": 0, "w2": 25, "w3": 0}
    assert tree.chars == len("system prompt, then user two")
    assert tree.tenants() == ["w2"]


def test_memory_stays_under_budget_after_a_hundred_thousand_distinct_prompts() -> None:
    budget = 1_000_000
    tree = PrefixTree(max_chars=budget)
    rng = random.Random(7)
    system = "You are a careful assistant. " * 20
    peak = 0
    for index in range(100_000):
        text = system + f"conversation {index}: " + os.urandom(40).hex()
        tree.insert(text, f"w{rng.randrange(8)}")
        peak = max(peak, tree.chars)
    assert peak <= budget
    assert tree.evicted_chars > 0
    # The shared system prompt is the hottest path: it is never evicted.
    assert max(tree.match(system, [f"w{i}" for i in range(8)]).values()) == len(system)


def test_a_budget_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(max_chars=0)

"""Near-ties drawn at random (so replicas reading the same loads spread), and the load the
policies compare: the engine's own count plus this process's, never the latter alone when
the engine says more."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.engines.kv_events.fleet_views import KvIndexes
from router.fleet.load import EngineShare
from router.fleet.ranks import RankChooser
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Worker
from router.policies.by_name import make_policy
from router.policies.cache_aware import CacheAware, CacheAwareSettings
from router.policies.kv_aware import KvAwareSettings, KvPolicyInputs
from router.policies.policy import PolicyKey
from router.policies.spread import NearTies, SpreadSettings

KEY = PolicyKey(model="m", role=Role.MIXED)


def worker(name: str, *, own: int = 0, engine: float | None = None, dp_size: int = 1) -> Worker:
    w = Worker(
        record=WorkerRecord(id=name, url=f"http://{name}.test:1", models=("m",), dp_size=dp_size),
        inflight=own,
    )
    w.keep_engine_shares()
    if engine is not None:
        for share in w.shares:
            share.observe(engine, taken_at=10.0, own_inflight=0, window_s=0.0)
    return w


def test_margin_zero_is_deterministic_and_draws_nothing() -> None:
    ties = NearTies(0.0, random.Random(1))
    scored = [(1.0, "a"), (1.0, "b"), (1.2, "c")]
    assert {ties.choose(scored, 0) for _ in range(50)} == {"a"}
    assert ties.drawn == 0


def test_candidates_within_the_margin_are_drawn_evenly_and_the_rest_never() -> None:
    ties = NearTies(0.5, random.Random(7))
    scored = [(2.0, "a"), (2.4, "b"), (2.5, "c"), (2.6, "d"), (9.0, "e")]
    picks = Counter(ties.choose(scored, 0) for _ in range(3000))
    assert set(picks) == {"a", "b", "c"}
    assert all(850 < count < 1150 for count in picks.values())
    assert ties.drawn == 3000


def test_a_single_best_within_its_margin_is_no_draw() -> None:
    ties = NearTies(0.5, random.Random(7))
    assert ties.choose([(1.0, "a"), (3.0, "b")], 0) == "a" and ties.drawn == 0


def test_a_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="margin"):
        SpreadSettings(margin=-0.1)


def test_least_load_reads_the_engines_count_not_only_its_own() -> None:
    # This process has nothing on either; another router filled `busy`.
    busy, idle = worker("busy", engine=6), worker("idle", engine=0)
    policy = make_policy("least_load")
    assert {policy.pick(KEY, [busy, idle]).id for _ in range(10)} == {"idle"}
    # Unknown is this process's own count: `unread` with 1 of ours is busier than `idle`.
    unread = worker("unread", own=1)
    assert policy.pick(KEY, [unread, idle]).id == "idle"


def test_replicas_with_the_same_snapshot_spread_instead_of_herding() -> None:
    fleet = [worker(f"w{i}", engine=load) for i, load in enumerate([2, 2, 2, 5])]
    # Three replicas, each its own generator: the first picks of a burst.
    picks = []
    for seed in range(3):
        policy = make_policy(
            "least_load", ties=NearTies(0.5, random.Random(seed)), rng=random.Random(seed)
        )
        picks.append(policy.pick(KEY, fleet).id)
    assert len(set(picks)) > 1 and "w3" not in picks
    # Without the spread every replica would make the same first pick.
    assert {make_policy("least_load").pick(KEY, fleet).id for _ in range(3)} == {"w0"}


def test_power_of_two_and_cache_aware_balance_read_the_engines_count() -> None:
    heavy, light = worker("heavy", engine=100), worker("light", engine=0)
    p2 = make_policy("power_of_two", rng=random.Random(3))
    assert {p2.pick(KEY, [heavy, light]).id for _ in range(20)} == {"light"}
    cache = CacheAware(CacheAwareSettings(balance_abs_threshold=4))
    text_key = PolicyKey(model="m", role=Role.MIXED, text="hello " * 40)
    cache.pick(text_key, [heavy])  # the prefix sits on `heavy`
    assert cache.pick(text_key, [heavy, light]).id == "light"
    assert cache.statistics()["picks_by_balance"] == 1


def test_kv_aware_costs_the_engines_load() -> None:
    busy, idle = worker("busy", engine=9), worker("idle", engine=0)
    kv = KvPolicyInputs(KvAwareSettings(), KvIndexes(), lambda: 0.0)
    policy = make_policy("kv_aware", kv=kv)
    assert policy.pick(KEY, [busy, idle]).id == "idle"


def test_the_rank_chooser_reads_each_ranks_engine_count() -> None:
    w = worker("dp", dp_size=2)
    w.shares[0].observe(4, taken_at=1.0, own_inflight=0, window_s=0.0)
    w.shares[1].observe(0, taken_at=1.0, own_inflight=0, window_s=0.0)
    chooser = RankChooser()
    assert [chooser.choose(w) for _ in range(4)] == [1, 1, 1, 1]
    assert isinstance(w.shares[0], EngineShare)

"""The cache_aware policy: load first, then the best prefix match, else the smallest tree."""

from __future__ import annotations

from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.policies.by_name import make_policy
from router.policies.cache_aware import MATCH_BLOCK_CHARS, CacheAware, CacheAwareSettings
from router.policies.policy import PolicyKey

LONG = "system: you are a helpful assistant who answers in full sentences.\n" * 8


def workers(*loads: int) -> list[Worker]:
    return [
        Worker(
            record=WorkerRecord(id=f"w{i}", url=f"http://w{i}.test:8000", models=("m",)),
            inflight=load,
        )
        for i, load in enumerate(loads)
    ]


def key(text: str | None, model: str = "m", role: Role = Role.MIXED) -> PolicyKey:
    return PolicyKey(model=model, role=role, text=text)


def policy(**overrides: float) -> CacheAware:
    return CacheAware(CacheAwareSettings(**overrides))  # type: ignore[arg-type]


def test_a_repeated_prompt_sticks_to_one_worker_while_loads_are_balanced() -> None:
    cache = policy()
    fleet = workers(0, 0, 0, 0)
    first = cache.pick(key(LONG + "user: one"), fleet)
    picks = {cache.pick(key(LONG + f"user: {n}"), fleet).id for n in range(20)}
    assert picks == {first.id}
    assert cache.statistics()["picks_by_match"] == 20


def test_distinct_prompts_spread_to_the_smallest_tree() -> None:
    cache = policy()
    fleet = workers(0, 0, 0)
    picks = [cache.pick(key(letter * 100), fleet).id for letter in "abc"]
    assert picks == ["w0", "w1", "w2"]
    assert cache.statistics()["picks_by_room"] == 3


def test_an_imbalance_beyond_both_thresholds_overrides_the_cache() -> None:
    cache = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    fleet = workers(0, 0)
    holder = cache.pick(key(LONG), fleet)
    other = fleet[1 - fleet.index(holder)]
    holder.inflight = 10
    other.inflight = 5  # gap 5 > 4 and 10 > 5 * 1.5: imbalanced
    assert cache.pick(key(LONG), fleet) is other
    # The text is still recorded under the worker that took it.
    tree = cache.tree("m", Role.MIXED)
    assert tree is not None and tree.match(LONG, [other.id])[other.id] == len(LONG)


def test_among_the_least_loaded_the_load_check_keeps_the_longest_match() -> None:
    cache = policy(balance_abs_threshold=2)
    fleet = workers(0, 0, 0)
    cache.pick(key("a" * 100), fleet)  # w0
    cache.pick(key("b" * 100), fleet)  # w1 (smallest tree)
    cache.pick(key("c" * 100), fleet)  # w2
    fleet[1].inflight = 9  # imbalanced: w0 and w2 are the least loaded
    assert cache.pick(key("c" * 100 + "d"), fleet) is fleet[2]
    assert cache.statistics()["picks_by_balance"] == 1


def test_only_one_threshold_crossed_keeps_the_cache() -> None:
    cache = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    fleet = workers(0, 0)
    holder = cache.pick(key(LONG), fleet)
    other = fleet[1 - fleet.index(holder)]
    holder.inflight, other.inflight = 100, 90  # gap 10 > 4, but 100 < 90 * 1.5
    assert cache.pick(key(LONG), fleet) is holder
    holder.inflight, other.inflight = 4, 0  # 4 > 0 * 1.5, but gap 4 is not > 4
    assert cache.pick(key(LONG), fleet) is holder


def test_a_match_below_the_threshold_goes_to_the_smallest_tree() -> None:
    cache = policy(cache_threshold=0.5)
    fleet = workers(0, 0)
    cache.pick(key("x" * 300), fleet)  # w0 holds 300 characters
    cache.pick(key("y" * 10), fleet)  # w1 holds 10
    # 40 of 100 characters match w0: 0.4 < 0.5, so the smaller tree (w1) wins.
    assert cache.pick(key("x" * 40 + "z" * 60), fleet).id == "w1"
    # At the threshold exactly, the match wins.
    assert cache.pick(key("x" * 50 + "q" * 50), fleet).id == "w0"


def test_a_best_match_that_is_not_a_candidate_gives_way_to_the_next() -> None:
    cache = policy()
    fleet = workers(0, 0, 0)
    holder = cache.pick(key(LONG), fleet)
    rest = [worker for worker in fleet if worker is not holder]
    chosen = cache.pick(key(LONG), rest)
    assert chosen in rest
    # Failing over left the prompt under the second worker too: it now matches there.
    assert cache.pick(key(LONG), rest) is chosen


def test_no_text_goes_to_the_smallest_tree_and_records_nothing() -> None:
    cache = policy()
    fleet = workers(0, 0)
    cache.pick(key("a" * 50), fleet)
    assert cache.pick(key(None), fleet).id == "w1"
    tree = cache.tree("m", Role.MIXED)
    assert tree is not None and tree.chars == 50


def test_models_and_roles_have_separate_trees() -> None:
    cache = policy()
    fleet = workers(0, 0)
    cache.pick(key(LONG, model="m"), fleet)
    cache.pick(key(LONG, model="other"), fleet)
    cache.pick(key(LONG, role=Role.PREFILL), fleet)
    assert cache.statistics()["trees"] == 3
    assert cache.statistics()["tree_chars"] == 3 * len(LONG)


def test_a_worker_leaving_the_fleet_leaves_every_tree() -> None:
    fleet = Fleet()
    for i in range(2):
        fleet.upsert(WorkerRecord(id=f"w{i}", url=f"http://w{i}.test:8000", models=("m",)))
    cache = policy()
    fleet.add_listener(cache)
    live = fleet.for_model("m")
    holder = cache.pick(key(LONG), live)
    fleet.remove(holder.id)
    assert cache.statistics()["trees"] == 0
    assert cache.statistics()["tree_chars"] == 0
    survivor = fleet.for_model("m")
    fleet.upsert(holder.record)  # it comes back with a cold cache
    again = fleet.for_model("m")
    assert cache.pick(key(LONG), again) is survivor[0]


def test_a_relist_that_drops_a_worker_forgets_it_too() -> None:
    fleet = Fleet()
    records = [
        WorkerRecord(id=f"w{i}", url=f"http://w{i}.test:8000", models=("m",)) for i in range(2)
    ]
    fleet.replace_all(records)
    cache = policy()
    fleet.add_listener(cache)
    holder = cache.pick(key(LONG), fleet.for_model("m"))
    fleet.replace_all([record for record in records if record.id != holder.id])
    tree = cache.tree("m", Role.MIXED)
    assert tree is None or holder.id not in tree.tenants()


def test_make_policy_builds_it_with_the_given_settings() -> None:
    made = make_policy("cache_aware", cache=CacheAwareSettings(max_tree_size=77))
    assert isinstance(made, CacheAware) and made.settings.max_tree_size == 77


def test_equal_matches_go_to_the_lower_load_then_the_smaller_tree() -> None:
    # Every worker holds the shared system prompt; w0 also holds a long conversation, so
    # a new conversation (matching only the shared prompt, equally everywhere) goes to the
    # least loaded, and among those where there is most room, not to the first candidate.
    cache = policy()
    fleet = workers(0, 0, 0)
    for worker in fleet:
        cache.pick(key(LONG + f"user: hello from {worker.id}"), [worker])
    cache.pick(key(LONG + "user: hello from w0" + " and more" * 200), [fleet[0]])
    fleet[0].inflight = fleet[2].inflight = 1
    assert cache.pick(key(LONG + "user: a new conversation"), fleet).id == "w1"
    fleet[1].inflight = 2  # w0 and w2 equally loaded: w2's tree is the smaller
    assert cache.pick(key(LONG + "user: another one"), fleet).id == "w2"
    assert cache.statistics()["picks_by_match"] == 2


def test_new_conversations_on_a_shared_prompt_fill_the_fleet_evenly() -> None:
    # Once every worker holds the shared prompt, new conversations stop piling on the
    # worker that holds most of them: their first words in common (under one block) do
    # not decide.
    shared = "s" * (10 * MATCH_BLOCK_CHARS)
    cache = policy()
    fleet = workers(0, 0, 0, 0)
    for worker in fleet:
        cache.pick(key(shared + "warm-up"), [worker])
    picks = [cache.pick(key(shared + f"user: conversation {n}"), fleet).id for n in range(40)]
    counts = {worker.id: picks.count(worker.id) for worker in fleet}
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_a_longer_match_by_a_whole_block_still_wins_over_load_and_room() -> None:
    shared = "s" * (4 * MATCH_BLOCK_CHARS)
    cache = policy(balance_abs_threshold=8)
    fleet = workers(0, 0)
    cache.pick(key(shared + "t" * MATCH_BLOCK_CHARS), [fleet[0]])
    cache.pick(key(shared + "u"), [fleet[1]])
    fleet[0].inflight = 5
    assert cache.pick(key(shared + "t" * MATCH_BLOCK_CHARS + "next turn"), fleet) is fleet[0]


def test_a_short_prompt_compares_exact_characters() -> None:
    cache = policy()
    fleet = workers(0, 0)
    cache.pick(key("hello world"), [fleet[1]])
    cache.pick(key("hello"), [fleet[0]])
    fleet[1].inflight = 3
    assert cache.pick(key("hello world"), fleet) is fleet[1]

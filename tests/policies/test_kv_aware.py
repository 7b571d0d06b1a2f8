"""The kv_aware policy over an index fed the engines' events: the longest held run wins
unless its load costs more; unknown views are never a hit; requests without tokens are
placed by load and counted."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from router.engines.kv_events import AllBlocksCleared, BlockStored
from router.engines.kv_events.fleet_views import KvIndexes
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Worker
from router.policies.by_name import POLICY_NAMES, make_policy
from router.policies.kv_aware import KvAware, KvAwareSettings, request_tokens
from router.policies.kv_aware_metrics import KvAwareCollector
from router.policies.policy import PolicyKey
from router.policies.spread import NearTies
from router.prompts.tokenizer import HfTokenizer

BS = 4
MODEL = "m"


def tokens(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(
    *loads: int, weight: float = KvAwareSettings().overlap_weight, known: bool = True
) -> tuple[KvAware, KvIndexes, list[Worker], Clock]:
    indexes = KvIndexes()
    index = indexes.for_model(MODEL)
    fleet = [
        Worker(
            record=WorkerRecord(id=f"w{i}", url=f"http://w{i}.test:8000", models=(MODEL,)),
            inflight=load,
        )
        for i, load in enumerate(loads)
    ]
    if known:
        for worker in fleet:
            index.apply_cleared((worker.id, None))  # an empty cache, known
    clock = Clock()
    return KvAware(KvAwareSettings(overlap_weight=weight), indexes, clock), indexes, fleet, clock


def store(indexes: KvIndexes, worker: str, ids: list[int], rank: int | None = None) -> None:
    count = len(ids) // BS
    indexes.for_model(MODEL).apply(
        (worker, rank),
        [BlockStored(list(range(1000, 1000 + count)), None, ids[: count * BS], BS)],
    )


def ids_key(ids: list[int], model: str = MODEL, role: Role = Role.MIXED) -> PolicyKey:
    return PolicyKey(model=model, role=role, body={"model": model, "input_ids": ids})


def test_the_worker_holding_the_prefix_wins_and_the_pick_is_counted_as_a_match() -> None:
    policy, indexes, fleet, _ = setup(0, 0, 0)
    store(indexes, "w1", tokens(0, 8))
    # The prompt extends the held prefix: 8 of its 10 blocks are on w1.
    assert policy.pick(ids_key(tokens(0, 10)), fleet).id == "w1"
    stats = policy.statistics()
    assert stats["picks_by_match"] == 1 and stats["predictions"] == 1


def test_load_beyond_the_blocks_saved_goes_elsewhere() -> None:
    policy, indexes, fleet, _ = setup(0, 5, weight=4.0)
    store(indexes, "w1", tokens(0, 4))
    # w1 saves the whole (typical) prompt, worth 4 requests, but carries 5: w0.
    assert policy.pick(ids_key(tokens(0, 4)), fleet).id == "w0"
    # At weight 6 the same blocks are worth 6 requests: w1.
    heavy, indexes2, fleet2, _ = setup(0, 5, weight=6.0)
    store(indexes2, "w1", tokens(0, 4))
    assert heavy.pick(ids_key(tokens(0, 4)), fleet2).id == "w1"


def test_the_weight_reads_the_same_whatever_the_prompts_length() -> None:
    # The same share of a typical prompt held against the same load decides the same
    # way, for prompts of 4 blocks and of 40 (as for a block size 10 times smaller).
    def pick(blocks: int, load: int) -> str:
        policy, indexes, fleet, _ = setup(0, load, weight=4.0)
        store(indexes, "w1", tokens(0, blocks))
        prompt = tokens(0, blocks)[: blocks * BS * 3 // 4] + tokens(10_000, blocks // 4)
        return policy.pick(ids_key(prompt), fleet).id

    for blocks in (4, 40):
        # w1 holds 3/4 of a typical prompt, worth 3 requests: it wins carrying 2, and
        # ties (to the lower load) carrying 3.
        assert (pick(blocks, 2), pick(blocks, 3)) == ("w1", "w0"), blocks


def test_a_prefix_shared_by_every_conversation_does_not_herd_them_onto_its_holder() -> None:
    # Only w0 holds the shared system prompt (7 of each new conversation's 12 blocks):
    # saving 7 blocks per request must not outweigh any load 6 clients can make.
    policy, indexes, fleet, _ = setup(0, 0, 0)
    system = tokens(0, 7)
    store(indexes, "w0", system)
    for conversation in range(6):
        own = tokens(10_000 * (conversation + 1), 5)
        policy.pick(ids_key([*system, *own]), fleet).inflight += 1  # as at dispatch
    loads = sorted(worker.inflight for worker in fleet)
    assert loads[-1] <= 3, loads
    assert loads[-2] >= 2, loads  # spread over a second engine at least


def test_the_spread_draws_among_equal_holders_and_never_leaves_a_cache_for_a_near_tie() -> None:
    """A conversation's second turn: w0 holds 9 of its 10 blocks, w1 and w2 the shared 7
    (the system prompt). Two blocks are worth 0.4 requests here, inside a 0.5 margin: a
    margin on the whole cost would draw w1 or w2 two times in three and send the
    conversation away from its cache. Among w1 and w2, equal holders, it still draws."""
    indexes = KvIndexes()
    index = indexes.for_model(MODEL)
    fleet = [
        Worker(record=WorkerRecord(id=f"w{i}", url=f"http://w{i}.test:8000", models=(MODEL,)))
        for i in range(3)
    ]
    for worker in fleet:
        index.apply_cleared((worker.id, None))
    system = tokens(0, 7)
    conversation = [*system, *tokens(10_000, 3)]
    store(indexes, "w0", conversation[: 9 * BS])
    store(indexes, "w1", system)
    store(indexes, "w2", system)
    ties = NearTies(0.5, random.Random(11))
    policy = KvAware(KvAwareSettings(overlap_weight=2.0), indexes, Clock(), ties=ties)
    policy.typical_blocks = 10.0
    assert {policy.pick(ids_key(conversation), fleet).id for _ in range(200)} == {"w0"}
    # New conversations: all three hold their system prompt alone (each pick's own blocks
    # are noted as routed, so every conversation is another): the draw spreads them over
    # every equal holder.
    picks = Counter(
        policy.pick(ids_key([*system, *tokens(100_000 * (n + 1), 3)]), fleet).id for n in range(300)
    )
    assert set(picks) == {"w0", "w1", "w2"} and min(picks.values()) > 60, picks


def test_ties_go_to_the_lower_load() -> None:
    policy, indexes, fleet, _ = setup(3, 1, 2)
    for worker in ("w0", "w1", "w2"):
        store(indexes, worker, tokens(0, 4))
    assert policy.pick(ids_key(tokens(0, 4)), fleet).id == "w1"


def test_an_unknown_view_is_never_read_as_a_hit_and_is_counted() -> None:
    policy, indexes, fleet, _ = setup(0, 1)
    store(indexes, "w0", tokens(0, 8))
    indexes.for_model(MODEL).mark_unknown(("w0", None), "replay lost the gap")
    # w0's entries are still in the index, but its view cannot be trusted: load decides.
    assert policy.pick(ids_key(tokens(0, 8)), fleet).id == "w0"  # lower load, not a hit
    stats = policy.statistics()
    assert stats["unknown_candidates"] == 1
    assert stats["picks_by_load"] == 1 and stats["picks_by_match"] == 0
    fleet[0].inflight = 2
    assert policy.pick(ids_key(tokens(0, 8)), fleet).id == "w1"


def test_requests_without_computable_tokens_are_placed_by_load_and_counted() -> None:
    policy, indexes, fleet, _ = setup(2, 0)
    store(indexes, "w0", tokens(0, 8))
    chat = PolicyKey(MODEL, Role.MIXED, body={"messages": [{"role": "user", "content": "hi"}]})
    assert policy.pick(chat, fleet).id == "w1"
    assert policy.pick(ids_key(tokens(0, 8), model="other"), fleet).id == "w1"
    assert policy.pick(ids_key([1, 2]), fleet).id == "w1"
    text = PolicyKey(MODEL, Role.MIXED, body={"prompt": "no tokenizer for this"})
    assert policy.pick(text, fleet).id == "w1"
    stats = policy.statistics()
    assert stats["no_prediction_chat_template"] == 1
    assert stats["no_prediction_no_tokens"] == 1
    assert stats["no_prediction_no_index"] == 1
    assert stats["no_prediction_short_prompt"] == 1
    assert stats["picks_by_no_prediction"] == 4 and stats["predictions"] == 0


def test_a_burst_of_a_new_prefix_follows_the_first_pick_until_the_ttl_ends() -> None:
    policy, indexes, fleet, clock = setup(0, 0, 0)
    store(indexes, "w2", tokens(500, 1))  # another prefix: the block size is known
    first = policy.pick(ids_key(tokens(0, 6)), fleet)
    assert first.id == "w0"
    first.inflight += 1  # the router's accounting, as at dispatch
    again = [policy.pick(ids_key([*tokens(0, 6), 9, 9]), fleet).id for _ in range(3)]
    assert again == [first.id] * 3
    clock.now = indexes.settings.pending_ttl_s + 0.001
    # No event confirmed the blocks: after the TTL the load decides again.
    assert policy.pick(ids_key(tokens(0, 6)), fleet).id != first.id


def test_the_rank_holding_the_blocks_scores_a_rank_multiplexed_worker() -> None:
    indexes = KvIndexes()
    index = indexes.for_model(MODEL)
    dp = Worker(
        record=WorkerRecord(id="dp", url="http://dp.test:8000", models=(MODEL,), dp_size=2),
        inflight=1,
        rank_inflight=[1, 0],
    )
    single = Worker(record=WorkerRecord(id="one", url="http://one.test:8000", models=(MODEL,)))
    for view in (("dp", 0), ("dp", 1), ("one", None)):
        index.apply_cleared(view)
    store(indexes, "dp", tokens(0, 6), rank=1)
    policy = KvAware(KvAwareSettings(), indexes, lambda: 0.0)
    assert policy.pick(ids_key(tokens(0, 6)), [single, dp]).id == "dp"
    # The blocks are noted under the rank that holds them, not rank 0.
    assert index.match(index.block_keys(tokens(0, 6)), 0.0).runs[("dp", 1)] == 6


def test_the_rank_holding_the_blocks_is_the_rank_the_policy_names() -> None:
    indexes = KvIndexes()
    index = indexes.for_model(MODEL)
    # Rank 1 holds the prompt and is the busier one: the held run still decides.
    dp = Worker(
        record=WorkerRecord(id="dp", url="http://dp.test:8000", models=(MODEL,), dp_size=2),
        inflight=2,
        rank_inflight=[0, 2],
    )
    for view in (("dp", 0), ("dp", 1)):
        index.apply_cleared(view)
    store(indexes, "dp", tokens(0, 6), rank=1)
    policy = KvAware(KvAwareSettings(), indexes, lambda: 0.0)
    worker, rank = policy.pick_ranked(ids_key(tokens(0, 6)), [dp])
    assert (worker.id, rank) == ("dp", 1)
    # Nothing held anywhere: the least-loaded known rank.
    assert policy.pick_ranked(ids_key(tokens(500, 6)), [dp])[1] == 0
    # No prediction (chat without a tokenizer): no rank named, the pipeline chooses.
    chat = PolicyKey(MODEL, Role.MIXED, body={"messages": [{"role": "user", "content": "hi"}]})
    assert policy.pick_ranked(chat, [dp]) == (dp, None)


def test_a_cleared_cache_stops_the_match() -> None:
    policy, indexes, fleet, _ = setup(0, 1)
    store(indexes, "w1", tokens(0, 8))
    assert policy.pick(ids_key(tokens(0, 8)), fleet).id == "w1"
    indexes.for_model(MODEL).apply(("w1", None), [AllBlocksCleared()])
    assert policy.pick(ids_key(tokens(0, 8)), fleet).id == "w0"


def test_request_tokens_reads_only_what_the_engine_computes_as_given() -> None:
    ids = [5, 6, 7]
    cases: list[tuple[dict[str, Any] | None, list[int] | None]] = [
        ({"input_ids": ids}, ids),
        ({"prompt": ids}, ids),
        ({"prompt": "text"}, None),
        ({"prompt": [ids, ids]}, None),  # a batch: several prompts, several placements
        ({"text": "hello"}, None),
        ({"messages": [], "input_ids": ids}, None),
        ({"prompt": [True, 2]}, None),
        (None, None),
    ]
    for body, expected in cases:
        assert request_tokens(body) == expected, body


def test_kv_aware_is_a_policy_by_name() -> None:
    assert "kv_aware" in POLICY_NAMES
    policy = make_policy("kv_aware")
    worker = Worker(record=WorkerRecord(id="w", url="http://w.test:8000", models=(MODEL,)))
    assert isinstance(policy, KvAware)
    assert policy.pick(ids_key(tokens(0, 4)), [worker]) is worker


def test_on_an_idle_fleet_new_prefixes_and_unpredicted_requests_take_turns() -> None:
    policy, indexes, fleet, _ = setup(0, 0, 0)
    store(indexes, "w2", tokens(500, 1))  # the block size is known; nobody holds these
    fresh = [policy.pick(ids_key(tokens(1000 * n, 4)), fleet).id for n in range(1, 4)]
    assert sorted(fresh) == ["w0", "w1", "w2"]
    chat = PolicyKey(MODEL, Role.MIXED, body={"messages": [{"role": "user", "content": "hi"}]})
    assert sorted(policy.pick(chat, fleet).id for _ in range(3)) == ["w0", "w1", "w2"]


def test_with_a_tokenizer_text_prompts_are_predicted_and_chat_is_counted_apart(
    tmp_path: Path,
) -> None:
    words = [f"w{n}" for n in range(40)]
    vocab = {"[UNK]": 0, "<s>": 1, **{word: n + 2 for n, word in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    # A BOS token, added as the engines add special tokens to a completions prompt.
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    path = tmp_path / "tokenizer.json"
    model.save(str(path))
    tokenizer = HfTokenizer(str(path))
    text = " ".join(words[:16])
    ids = tokenizer.encode(text)
    assert ids == [1, *range(2, 18)]

    policy, indexes, fleet, _ = setup(0, 1)
    policy.tokenizer = tokenizer
    store(indexes, "w1", ids)
    completion = PolicyKey(MODEL, Role.MIXED, body={"model": MODEL, "prompt": text})
    assert policy.pick(completion, fleet).id == "w1"
    generate = PolicyKey(MODEL, Role.MIXED, body={"model": MODEL, "text": text})
    assert policy.pick(generate, fleet).id == "w1"
    chat = PolicyKey(MODEL, Role.MIXED, body={"messages": [{"role": "user", "content": text}]})
    assert policy.pick(chat, fleet).id == "w0"
    stats = policy.statistics()
    assert stats["picks_by_match"] == 2
    assert stats["no_prediction_chat_template"] == 1 and stats["no_prediction_no_tokens"] == 0


def test_a_tokenizer_file_that_cannot_be_loaded_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        HfTokenizer(str(bad))


def test_the_predicted_hits_are_what_the_engines_prefix_cache_will_count() -> None:
    """Whole held blocks of the chosen worker, never the prompt's last token (an engine
    always computes it): the numerator of the router's match rate, on /metrics."""
    policy, indexes, fleet, _ = setup(0, 0)
    store(indexes, "w1", tokens(0, 10))
    policy.pick(ids_key([*tokens(0, 8), 9999, 9998]), fleet)  # 8 held blocks + 2 of its own
    assert policy.statistics()["predicted_hit_tokens"] == 8 * BS
    policy.pick(ids_key(tokens(0, 10)), fleet)  # all 10 held: the last block is computed
    policy.pick(ids_key(tokens(500, 3)), fleet)  # held nowhere
    stats = policy.statistics()
    assert stats["predicted_hit_tokens"] == 8 * BS + 9 * BS
    assert stats["predicted_prompt_tokens"] == (8 * BS + 2) + 10 * BS + 3 * BS
    families = {
        family.name: family
        for family in KvAwareCollector({Role.MIXED: policy}, indexes=indexes).collect()
    }
    (hits,) = families["router_kv_aware_predicted_hit_tokens"].samples
    (prompt,) = families["router_kv_aware_prompt_tokens"].samples
    assert (hits.labels, hits.value) == ({"role": "mixed"}, 17 * BS)
    assert prompt.value == stats["predicted_prompt_tokens"]


def test_a_cache_salt_keys_the_first_block_as_the_engines_events_do() -> None:
    """vLLM salts a request's first block (`cache_salt`), and its BlockStored carries the
    salt as that block's extra key: a salted prompt matches only blocks stored under the
    same salt, and an unsalted one never matches salted blocks."""
    policy, indexes, fleet, _ = setup(0, 0, 0)
    ids = tokens(0, 4)
    indexes.for_model(MODEL).apply(
        ("w2", None),
        [BlockStored([1, 2, 3, 4], None, ids, BS, extra_keys=[("s1",), None, None, None])],
    )
    store(indexes, "w1", ids)  # the same tokens, unsalted

    def body(**salt: str) -> PolicyKey:
        return PolicyKey(model=MODEL, role=Role.MIXED, body={"input_ids": [*ids, 7], **salt})

    assert policy.pick(body(cache_salt="s1"), fleet).id == "w2"
    assert policy.pick(body(), fleet).id == "w1"
    assert policy.statistics()["predicted_hit_tokens"] == 2 * 4 * BS
    policy.pick(body(cache_salt="s2"), fleet)
    stats = policy.statistics()
    assert stats["predicted_hit_tokens"] == 2 * 4 * BS and stats["picks_by_load"] == 1

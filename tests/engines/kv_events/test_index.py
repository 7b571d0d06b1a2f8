"""The index: keys of our own, removals through the engine-hash map, bounds, unknown views,
and the pending hold. Pure and synchronous: time is a plain float passed in."""

from __future__ import annotations

from router.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexSettings,
    KvIndex,
    ViewId,
    ViewState,
)

BS = 4
A: ViewId = ("a", None)
B: ViewId = ("b", None)


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count * BS))


def store(
    hashes: list[int | bytes], parent: int | bytes | None, token_ids: list[int], **kw: object
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=BS,
        medium="GPU",
        **kw,  # type: ignore[arg-type]
    )


def fresh(*views: ViewId, settings: IndexSettings | None = None) -> KvIndex:
    index = KvIndex(settings)
    for view in views:
        index.apply(view, [AllBlocksCleared()])  # known and empty
    return index


def test_keys_do_not_depend_on_the_engines_hashes() -> None:
    index = fresh(A, B)
    prompt = tokens(0, 3)
    # Worker a hashes with one seed (ints), worker b with another (bytes), and b stores
    # the same three blocks in two events chained through its own parent hash.
    index.apply(A, [store([101, 102, 103], None, prompt)])
    index.apply(B, [store([b"x1", b"x2"], None, prompt[: 2 * BS])])
    index.apply(B, [store([b"x3"], b"x2", prompt[2 * BS :])])
    keys = index.block_keys([*prompt, 999])  # a partial last block does not count
    assert len(keys) == 3
    result = index.match(keys, now=0.0)
    assert result.runs == {A: 3, B: 3}
    assert result.blocks == 3
    assert index.match(index.block_keys(tokens(0, 1) + tokens(100, 1)), now=0.0).runs == {
        A: 1,
        B: 1,
    }


def test_block_size_is_learned_from_the_first_store() -> None:
    index = fresh(A)
    assert index.block_keys(tokens(0, 3)) == []
    assert index.match([], now=0.0).blocks == 0
    index.apply(A, [store([1], None, tokens(0, 1))])
    assert index.block_size == BS
    assert len(index.block_keys(tokens(0, 3))) == 3


def test_lora_and_extra_keys_are_part_of_the_key() -> None:
    index = fresh(A)
    prompt = tokens(0, 2)
    index.apply(A, [store([1, 2], None, prompt, lora_name="ad", extra_keys=[("img", 7), None])])
    assert index.match(index.block_keys(prompt), now=0.0).runs == {A: 0}
    assert index.match(index.block_keys(prompt, lora_name="ad"), now=0.0).runs == {A: 0}
    keys = index.block_keys(prompt, lora_name="ad", extra_keys=[("img", 7), None])
    assert index.match(keys, now=0.0).runs == {A: 2}


def test_block_removed_goes_through_the_engine_hash_map() -> None:
    index = fresh(A, B)
    prompt = tokens(0, 3)
    index.apply(A, [store([1, 2, 3], None, prompt)])
    index.apply(B, [store([1, 2, 3], None, prompt)])  # same engine hashes, other worker
    index.apply(A, [BlockRemoved(block_hashes=[2], medium="GPU")])
    keys = index.block_keys(prompt)
    assert index.match(keys, now=0.0).runs == {A: 1, B: 3}
    assert len(index) == 5
    index.apply(A, [BlockRemoved(block_hashes=[99], medium="GPU")])
    assert index.statistics().unknown_removals == 1
    assert index.statistics().removed_blocks == 1


def test_duplicate_stores_of_one_hash_need_as_many_removals() -> None:
    # vLLM does not deduplicate cached blocks: two requests can each cache the same hash.
    index = fresh(A)
    index.apply(A, [store([1], None, tokens(0, 1)), store([1], None, tokens(0, 1))])
    keys = index.block_keys(tokens(0, 1))
    index.apply(A, [BlockRemoved(block_hashes=[1], medium="GPU")])
    assert index.match(keys, now=0.0).runs == {A: 1}
    index.apply(A, [BlockRemoved(block_hashes=[1], medium="GPU")])
    assert index.match(keys, now=0.0).runs == {A: 0}
    assert len(index) == 0


def test_other_media_are_not_indexed_and_do_not_remove_gpu_blocks() -> None:
    index = fresh(A)
    index.apply(A, [store([1], None, tokens(0, 1))])
    index.apply(A, [BlockRemoved(block_hashes=[1], medium="CPU")])
    index.apply(
        A,
        [
            BlockStored(
                block_hashes=[5], parent_block_hash=None, token_ids=[], block_size=BS, medium="CPU"
            )
        ],
    )
    assert index.match(index.block_keys(tokens(0, 1)), now=0.0).runs == {A: 1}
    assert index.statistics().ignored_blocks == 2
    assert index.view_state(A) is ViewState.KNOWN


def test_all_blocks_cleared_drops_only_that_view() -> None:
    index = fresh(A, B)
    prompt = tokens(0, 2)
    index.apply(A, [store([1, 2], None, prompt)])
    index.apply(B, [store([1, 2], None, prompt)])
    index.apply(A, [AllBlocksCleared()])
    assert index.match(index.block_keys(prompt), now=0.0).runs == {A: 0, B: 2}
    assert len(index) == 2


def test_unknown_parent_marks_the_view_unknown_and_it_is_not_read_as_empty() -> None:
    index = fresh(A, B)
    prompt = tokens(0, 2)
    index.apply(A, [store([1], None, prompt[:BS])])
    index.apply(B, [store([1, 2], None, prompt)])
    index.apply(A, [store([3], 777, prompt[BS:])])  # parent 777 never seen: an event was lost
    assert index.view_state(A) is ViewState.UNKNOWN
    assert index.view_reason(A) == "BlockStored parent not held"
    result = index.match(index.block_keys(prompt), now=0.0)
    assert result.runs == {B: 2}
    assert result.unknown == frozenset({A})
    assert index.statistics().orphan_blocks == 1
    # AllBlocksCleared rebuilds it: empty and known.
    index.apply(A, [AllBlocksCleared()])
    assert index.match(index.block_keys(prompt), now=0.0).runs == {A: 0, B: 2}


def test_a_view_never_reset_is_unknown() -> None:
    index = KvIndex()
    index.apply(A, [store([1], None, tokens(0, 1))])
    assert index.view_state(A) is ViewState.UNKNOWN
    assert index.view_state(B) is None
    assert index.match(index.block_keys(tokens(0, 1)), now=0.0).unknown == frozenset({A})


def test_a_block_size_that_disagrees_marks_the_view_unknown() -> None:
    index = fresh(A, B)
    index.apply(A, [store([1], None, tokens(0, 1))])
    index.apply(
        B, [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0] * 8, block_size=8)]
    )
    assert index.view_state(B) is ViewState.UNKNOWN
    index.apply(
        A,
        [
            BlockStored(
                block_hashes=[2, 3], parent_block_hash=None, token_ids=[0] * 4, block_size=BS
            )
        ],
    )
    assert index.view_state(A) is ViewState.UNKNOWN
    assert index.statistics().inconsistent_events == 2


def test_lru_cap_evicts_the_least_recently_used_and_matching_refreshes() -> None:
    index = fresh(A, settings=IndexSettings(max_entries=3))
    index.apply(A, [store([1], None, tokens(0, 1))])
    index.apply(A, [store([2], None, tokens(100, 1))])
    index.apply(A, [store([3], None, tokens(200, 1))])
    first = index.block_keys(tokens(0, 1))
    assert index.match(first, now=0.0).runs == {A: 1}  # block 1 becomes the most recent
    index.apply(A, [store([4], None, tokens(300, 1))])
    assert len(index) == 3
    assert index.statistics().evicted_entries == 1
    assert index.match(first, now=0.0).runs == {A: 1}
    assert index.match(index.block_keys(tokens(100, 1)), now=0.0).runs == {A: 0}  # evicted
    # A child of a block we evicted ourselves is not indexed, but the view stays known.
    index.apply(A, [store([5], 2, tokens(101, 1))])
    assert index.view_state(A) is ViewState.KNOWN
    assert index.statistics().orphan_blocks == 1
    # Removing an evicted block is harmless.
    index.apply(A, [BlockRemoved(block_hashes=[2], medium="GPU")])
    assert len(index) == 3


def test_forget_worker_drops_all_its_views_and_entries() -> None:
    index = fresh(A, ("a", 1), B)
    prompt = tokens(0, 2)
    for view in (A, ("a", 1), B):
        index.apply(view, [store([1, 2], None, prompt)])
    index.note_routed(index.block_keys(tokens(50, 1)), "a", 1, now=0.0)
    assert len(index) == 6
    index.forget_worker("a")
    assert len(index) == 2
    assert index.statistics().pending == 0
    assert index.match(index.block_keys(prompt), now=0.0).runs == {B: 2}
    assert index.view_state(A) is None


def test_pending_hold_counts_until_its_ttl_and_events_replace_it() -> None:
    index = fresh(A, B, settings=IndexSettings(pending_ttl_s=2.0))
    prompt = tokens(0, 3)
    index.apply(A, [store([1], None, prompt[:BS])])
    keys = index.block_keys(prompt)
    index.note_routed(keys, "b", None, now=10.0)
    assert index.match(keys, now=10.0).runs == {A: 1, B: 3}
    assert index.match(keys, now=11.999).runs == {A: 1, B: 3}
    assert index.match(keys, now=12.0).runs == {A: 1, B: 0}
    assert index.statistics().pending == 0
    # The engine's own store replaces the guess: it outlives the TTL.
    index.note_routed(keys, "b", None, now=20.0)
    index.apply(B, [store([7, 8], None, prompt[: 2 * BS])])
    assert index.statistics().pending == 1
    assert index.match(keys, now=21.0).runs == {A: 1, B: 3}
    assert index.match(keys, now=30.0).runs == {A: 1, B: 2}
    # A view the index does not know takes no pending hold.
    index.note_routed(keys, "c", None, now=30.0)
    assert ("c", None) not in index.match(keys, now=30.0).runs


def test_pending_hold_is_bounded() -> None:
    index = fresh(A, settings=IndexSettings(max_pending=2, pending_ttl_s=5.0))
    index.apply(A, [store([1], None, tokens(0, 1))])
    keys = index.block_keys(tokens(1000, 3))
    index.note_routed(keys, "a", None, now=0.0)
    assert index.statistics().pending == 2
    assert index.match(keys, now=1.0).runs == {A: 0}  # the first one was dropped

"""A `grpc://` worker's KV-event stream, batch by batch: what each batch does to the views.

The batches are the published `KvEventBatch` messages, serialized as the engine sends
them; the stream itself (a real call to the fake gRPC engine) is tested in
tests/integration/test_grpc_kv_events.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from smg_grpc_proto.generated import common_pb2

from router.engines.kv_events import KvIndex, ViewState
from router.engines.kv_events.grpc_subscription import (
    REASON_JOINED_LATE,
    REASON_LOST_BATCHES,
    REASON_SNAPSHOT_PARTIAL,
    REASON_SUBSCRIBING,
    GrpcKvSource,
    GrpcKvSubscription,
    to_batch,
)
from router.http.grpc import GrpcPool, open_grpc_pool

WORKER = "w1"
SIZE = 4


@pytest.fixture
async def pool() -> AsyncIterator[GrpcPool]:
    async with open_grpc_pool() as opened:
        yield opened


def subscription(pool: GrpcPool, views: dict[int, int | None] | None = None) -> GrpcKvSubscription:
    source = GrpcKvSource(WORKER, "grpc://127.0.0.1:1", views or {0: None})
    sub = GrpcKvSubscription(source, KvIndex(), pool)
    for view in sub.views():
        sub.index.mark_unknown(view, REASON_SUBSCRIBING)
    return sub


def stored(
    hashes: Sequence[int], first_token: int, parent: int | None = None, **fields: Any
) -> common_pb2.KvCacheEvent:
    blocks = [
        common_pb2.KvBlock(
            block_hash=h,
            token_ids=range(first_token + i * SIZE, first_token + (i + 1) * SIZE),
            block_size=SIZE,
        )
        for i, h in enumerate(hashes)
    ]
    event = common_pb2.KvBlocksStored(blocks=blocks, medium="GPU", **fields)
    if parent is not None:
        event.parent_block_hash = parent
    return common_pb2.KvCacheEvent(stored=event)


def removed(hashes: Sequence[int]) -> common_pb2.KvCacheEvent:
    return common_pb2.KvCacheEvent(
        removed=common_pb2.KvBlocksRemoved(block_hashes=hashes, medium="GPU")
    )


def cleared() -> common_pb2.KvCacheEvent:
    return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())


def batch(seq: int, *events: common_pb2.KvCacheEvent, rank: int = 0, **fields: Any) -> bytes:
    return common_pb2.KvEventBatch(
        sequence_number=seq, timestamp=1.0, events=events, dp_rank=rank, **fields
    ).SerializeToString()


def held(sub: GrpcKvSubscription, first_token: int, blocks: int, rank: int | None = None) -> int:
    """How many of the blocks from `first_token` the index says the view holds; -1 when
    the view is unknown."""
    index = sub.index
    keys = index.block_keys(list(range(first_token, first_token + blocks * SIZE)))
    result = index.match(keys, now=0.0)
    view = (WORKER, rank)
    if view in result.unknown:
        return -1
    return max((run for v, run in result.runs.items() if v == view), default=0)


async def test_a_stream_from_the_engines_first_batch_is_known_and_follows_every_event(
    pool: GrpcPool,
) -> None:
    sub = subscription(pool)
    sub._on_message(batch(0, stored([11, 12], 100)))
    assert sub.index.view_state((WORKER, None)) is ViewState.KNOWN
    assert held(sub, 100, 2) == 2
    sub._on_message(batch(1, stored([13], 108, parent=12)))
    assert held(sub, 100, 3) == 3
    sub._on_message(batch(2, removed([13])))
    assert held(sub, 100, 3) == 2
    assert sub.statistics().events == {"BlockStored": 2, "BlockRemoved": 1, "AllBlocksCleared": 0}
    assert (sub.statistics().batches, sub.statistics().last_seq) == (3, 2)


async def test_joining_after_the_first_batch_leaves_the_view_unknown_until_a_clear(
    pool: GrpcPool,
) -> None:
    # The relay streams live only: what the engine cached before the call is unseen, so
    # the view must not say "holds nothing".
    sub = subscription(pool)
    sub._on_message(batch(7, stored([11], 100)))
    assert sub.index.view_reason((WORKER, None)) == REASON_JOINED_LATE
    assert held(sub, 100, 1) == -1
    sub._on_message(batch(8, cleared(), stored([21], 200)))
    assert sub.index.view_state((WORKER, None)) is ViewState.KNOWN
    assert (held(sub, 100, 1), held(sub, 200, 1)) == (0, 1)


async def test_a_skipped_sequence_makes_the_view_unknown_and_a_repeat_is_skipped(
    pool: GrpcPool,
) -> None:
    sub = subscription(pool)
    sub._on_message(batch(0, stored([11], 100)))
    sub._on_message(batch(0, stored([99], 900)))  # a copy (or a load-only record)
    assert held(sub, 900, 1) == 0
    sub._on_message(batch(2, stored([12], 104, parent=11)))
    assert sub.index.view_reason((WORKER, None)) == REASON_LOST_BATCHES
    assert held(sub, 100, 1) == -1
    assert sub.statistics().gaps == 1


async def test_each_rank_of_a_multiplexed_worker_is_its_own_view_and_sequence(
    pool: GrpcPool,
) -> None:
    sub = subscription(pool, {0: 0, 1: 1})
    sub._on_message(batch(0, stored([11], 100), rank=0))
    sub._on_message(batch(4, stored([11], 200), rank=1))
    sub._on_message(batch(1, stored([12], 300), rank=0))
    sub._on_message(batch(0, stored([12], 400), rank=2))  # not a rank of this worker
    assert sub.index.view_state((WORKER, 0)) is ViewState.KNOWN
    assert sub.index.view_reason((WORKER, 1)) == REASON_JOINED_LATE
    assert (held(sub, 100, 1, rank=0), held(sub, 300, 1, rank=0)) == (1, 1)
    assert sub.statistics().rank_mismatches == 1


async def test_a_snapshot_rebuilds_the_view_and_a_partial_one_leaves_it_unknown(
    pool: GrpcPool,
) -> None:
    whole = subscription(pool)
    whole._on_message(
        batch(
            40,
            stored([11], 100),
            snapshot=common_pb2.KvSnapshotChunk(index=0, count=2, blocks=2, unknown_before=0),
        )
    )
    assert whole.index.view_reason((WORKER, None)) == REASON_SUBSCRIBING
    whole._on_message(
        batch(41, stored([21], 200), snapshot=common_pb2.KvSnapshotChunk(index=1, count=2))
    )
    whole._on_message(batch(42, stored([12], 104, parent=11)))
    assert whole.index.view_state((WORKER, None)) is ViewState.KNOWN
    assert (held(whole, 100, 2), held(whole, 200, 1)) == (2, 1)

    partial = subscription(pool)
    partial._on_message(
        batch(
            9,
            stored([11], 100),
            snapshot=common_pb2.KvSnapshotChunk(index=0, count=1, blocks=1, unknown_before=3),
        )
    )
    assert partial.index.view_reason((WORKER, None)) == REASON_SNAPSHOT_PARTIAL


async def test_a_batch_that_does_not_parse_is_counted_and_the_view_unknown(
    pool: GrpcPool,
) -> None:
    sub = subscription(pool)
    sub._on_message(batch(0, stored([11], 100)))
    sub._on_message(b"\xff\xff\xff")
    assert sub.statistics().decode_errors == 1
    assert held(sub, 100, 1) == -1


def test_the_relays_fields_map_to_the_events_the_zmq_path_decodes() -> None:
    event = stored([11, 12], 100, parent=10, lora_name="a", group_idx=0)
    event.stored.blocks[0].extra_keys.append(common_pb2.KvBlockExtraKey(text="a"))
    event.stored.blocks[1].extra_keys.append(
        common_pb2.KvBlockExtraKey(multimodal=common_pb2.KvMultimodalKey(identifier="m", offset=3))
    )
    proto = common_pb2.KvEventBatch(sequence_number=0, timestamp=2.5, events=[event, cleared()])
    decoded = to_batch(proto)
    first = decoded.events[0]
    assert decoded.dp_rank is None and decoded.ts == 2.5
    assert first.block_hashes == [11, 12] and first.parent_block_hash == 10  # type: ignore[union-attr]
    assert first.token_ids == list(range(100, 108)) and first.block_size == SIZE  # type: ignore[union-attr]
    assert (first.lora_name, first.medium, first.group_idx) == ("a", "GPU", 0)  # type: ignore[union-attr]
    assert first.extra_keys == [("a",), (("m", 3),)]  # type: ignore[union-attr]
    assert type(decoded.events[1]).__name__ == "AllBlocksCleared"

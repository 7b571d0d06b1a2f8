"""The fake gRPC engine's KV-cache events: its prefix cache's changes, streamed over
`SubscribeKvEvents` in the shape vLLM's gRPC servicer relays its engine's ZMQ events.

The servicer (`smg_grpc_servicer.kv_relay.relay`, 0.14.1) gives each call what the
engine publishes after it subscribed, live only: no history, no snapshot, and a
non-zero `start_sequence_number` is OUT_OF_RANGE. Every `KvEventBatch` carries the
publisher's own `sequence_number` (from 0 for the process, every batch counted whether
or not anyone listened), the batch's `timestamp` and `dp_rank`; its events are what the
relay's `Normalizer` makes of vLLM's: `stored` with one `KvBlock` per block (hash, its
16 token ids, `block_size`), the run's `parent_block_hash` when it has one, tier DEVICE,
locality LOCAL, medium `GPU`; `removed` with the hashes, tier, locality and medium;
`cleared` empty. `event_id` counts the call's events from 1, as each relay call's
normalizer does. A stream the relay cannot keep whole ends with DATA_LOSS.

Here the publisher is `KvEventHub`, the prefix cache's `CacheListener`: one batch per
change (a prompt's new run of blocks, an eviction, a flush), handed at once to every
live `Subscription`. The fake has one cache and one publisher, rank 0's, whatever its
DP size, as the HTTP fake has.

Block hashes are the cache's keys (Python's `hash`, chained per block) folded to the
proto's signed 64 bits by `fold_hash`: the low 64 bits as two's complement, the fold
the relay applies to an integer hash, so a key's store and its removal carry the same
number.

Each subscription queues at most `SUBSCRIBER_QUEUE` batches its call has not written
yet; one more ends that call with DATA_LOSS ("subscriber fell behind"), the others go on.
A lost subscription drops its queue at once; its call ends when it next takes a batch
(at once, unless it is still writing the last one to a client that does not read).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2

from router.fake_worker.prefix_cache import BLOCK_TOKENS, block_token_ids

SUBSCRIBER_QUEUE = 4096
"""Batches a subscription may hold unwritten; one more and its call ends DATA_LOSS."""
FELL_BEHIND = "subscriber fell behind"
SCRIPTED_LOSS = "scripted data loss"
MEDIUM = "GPU"  # what vLLM's publisher names the device tier

_U64 = (1 << 64) - 1
_I64_SIGN = 1 << 63


def fold_hash(key: int) -> int:
    """A prefix-cache key as the proto's int64: its low 64 bits as two's complement."""
    masked = key & _U64
    return masked - (1 << 64) if masked >= _I64_SIGN else masked


class SubscriptionLost(Exception):
    """The subscription can no longer be kept whole; the message says why."""


class Subscription:
    """One `SubscribeKvEvents` call's queue of batches not yet written."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.lost: str | None = None
        self._batches: deque[common_pb2.KvEventBatch] = deque()
        self._ready = asyncio.Event()
        self._event_id = 0

    def offer(self, batch: common_pb2.KvEventBatch) -> bool:
        """Queue `batch`; False (and the subscription lost) when the queue is full."""
        if len(self._batches) >= self.bound:
            self.lose(FELL_BEHIND)
            return False
        self._batches.append(batch)
        self._ready.set()
        return True

    def lose(self, why: str) -> None:
        """End the subscription: its queue goes now, its call at its next batch."""
        if self.lost is None:
            self.lost = why
        self._batches.clear()
        self._ready.set()

    async def next_batch(self) -> common_pb2.KvEventBatch:
        """The oldest batch not yet taken, its events numbered for this call; raises
        SubscriptionLost once the subscription is lost, queued batches or not."""
        while self.lost is None and not self._batches:
            self._ready.clear()
            await self._ready.wait()
        if self.lost is not None:
            raise SubscriptionLost(self.lost)
        shared = self._batches.popleft()
        batch = common_pb2.KvEventBatch()
        batch.CopyFrom(shared)  # the batch is every subscriber's; event ids are per call
        for event in batch.events:
            self._event_id += 1
            event.event_id = self._event_id
        return batch


@dataclass(frozen=True, slots=True)
class KvEventStatistics:
    next_sequence: int
    """The sequence number the next batch gets."""
    published: int
    """Batches the cache produced (those a skip jumped over are not counted)."""
    opened: int
    """Subscriptions taken."""
    live: int
    """Subscriptions taking batches now."""
    data_loss: int
    """Subscriptions ended with DATA_LOSS (fell behind, or scripted)."""

    def to_json(self) -> dict[str, int]:
        """`/debug/routing`'s `kv_events` object."""
        return {
            "next_sequence": self.next_sequence,
            "published": self.published,
            "subscriptions_opened": self.opened,
            "subscriptions_live": self.live,
            "subscriptions_data_loss": self.data_loss,
        }


class KvEventHub:
    """The prefix cache's `CacheListener`: each change one `KvEventBatch`, numbered in
    order, offered to every live subscription. Synchronous: a batch is queued for every
    subscriber before the change's request goes on."""

    def __init__(self, dp_rank: int = 0) -> None:
        self.dp_rank = dp_rank
        self.next_sequence = 0
        self.published = 0
        self.opened = 0
        self.data_loss = 0
        self._live: set[Subscription] = set()

    # -- CacheListener -----------------------------------------------------------------

    def stored(
        self,
        parent: int | None,
        keys: Sequence[int],
        blocks: Sequence[object],
        lora_name: str | None = None,
    ) -> None:
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(
                    block_hash=fold_hash(key),
                    token_ids=block_token_ids(block),
                    block_size=BLOCK_TOKENS,
                )
                for key, block in zip(keys, blocks, strict=True)
            ],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
            medium=MEDIUM,
        )
        if parent is not None:
            stored.parent_block_hash = fold_hash(parent)
        if lora_name is not None:
            stored.lora_name = lora_name
        self._publish(common_pb2.KvCacheEvent(stored=stored))

    def removed(self, keys: Sequence[int]) -> None:
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=[fold_hash(key) for key in keys],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
            medium=MEDIUM,
        )
        self._publish(common_pb2.KvCacheEvent(removed=removed))

    def cleared(self) -> None:
        self._publish(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))

    def _publish(self, event: common_pb2.KvCacheEvent) -> None:
        batch = common_pb2.KvEventBatch(
            sequence_number=self.next_sequence,
            timestamp=time.time(),  # wall-clock: vLLM stamps a batch in epoch seconds
            events=[event],
            dp_rank=self.dp_rank,
        )
        self.next_sequence += 1
        self.published += 1
        for subscription in list(self._live):
            if not subscription.offer(batch):
                self._end(subscription)

    # -- subscriptions -----------------------------------------------------------------

    @contextmanager
    def subscribe(self) -> Iterator[Subscription]:
        """A live subscription, from the next batch on, until the block is left.
        Cancellation: the subscription and its queue are gone."""
        subscription = Subscription(SUBSCRIBER_QUEUE)
        self.opened += 1
        self._live.add(subscription)
        try:
            yield subscription
        finally:
            self._live.discard(subscription)
            subscription.lose("unsubscribed")

    def _end(self, subscription: Subscription) -> None:
        """A subscription lost: out of the live set, counted."""
        if subscription in self._live:
            self._live.discard(subscription)
            self.data_loss += 1

    def lose_all(self, why: str = SCRIPTED_LOSS) -> int:
        """End every live subscription with DATA_LOSS (`why`); how many there were."""
        ended = list(self._live)
        for subscription in ended:
            subscription.lose(why)
            self._end(subscription)
        return len(ended)

    def skip(self, batches: int) -> None:
        """Number the next batch `batches` later, as if the relay had lost that many."""
        if batches < 0:
            raise ValueError(f"a skip goes forward: got {batches}")
        self.next_sequence += batches

    def reset_counters(self) -> None:
        """Zero `opened` and `data_loss`; the sequence and live subscriptions stay."""
        self.opened = 0
        self.data_loss = 0

    def statistics(self) -> KvEventStatistics:
        return KvEventStatistics(
            self.next_sequence, self.published, self.opened, len(self._live), self.data_loss
        )

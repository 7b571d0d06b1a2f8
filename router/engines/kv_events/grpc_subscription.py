"""One subscription to a `grpc://` worker's KV-cache events (`SubscribeKvEvents`), feeding
the index with the same events as the ZMQ subscription does.

The engine side, as vLLM's gRPC servicer serves it (`smg_grpc_servicer.kv_relay`): one
server stream per call carries every DP rank's batches (`KvEventBatch`), each under its
rank's own publisher sequence, with the rank on the batch. The stream is live only: a
call gets the batches published after it subscribed, no history and no snapshot; a
non-zero `start_sequence_number` is refused (OUT_OF_RANGE); a gap the relay cannot
repair, or a publisher that restarted its sequence, ends the call with DATA_LOSS; an
engine without KV events answers UNIMPLEMENTED. Relays that keep a history (smg's own)
may open a call with a snapshot of the cache (`KvSnapshotChunk`s), which rebuilds the
view.

What the router makes of it, per view (worker, rank):
- subscribing: the view is unknown until its rank's first batch.
- the first batch is the publisher's batch 0 (the engine's whole life is seen), or the
  last chunk of a snapshot whose record reaches back to the start (`unknown_before` 0):
  the view is rebuilt and known.
- the first batch comes later than 0: what the engine cached before is unseen, so the
  view stays unknown (never read as "holds nothing") until the engine clears its cache
  (`cleared`) or restarts (its next stream starts at 0 again). Events are still applied,
  so a clear finds the view ready.
- a batch whose sequence skips (a batch lost on the way): unknown, as above.
- a batch repeating or preceding the last one: skipped (a load-only record, a copy).
- DATA_LOSS, a broken connection, the call ending: the views are unknown and the call
  is made again, at once after DATA_LOSS, else after a backoff of at most 1 s (so a
  restarted engine is subscribed to before its first batch); UNIMPLEMENTED (no KV
  events at this engine): unknown, asked again after `retry_max_s` (30 s).

The engine's load on the batches (`EngineLoad`) is not read here: the load reader asks
`GetLoads`. The call holds one of the worker's gRPC call slots while it runs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from router.engines.kv_events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExtraKey,
    KvEvent,
)
from router.engines.kv_events.index import KvIndex, ViewId
from router.engines.kv_events.subscription import SubscriptionSettings, SubscriptionStatistics
from router.http.grpc import GrpcError, GrpcPool
from router.http.grpc.status import GrpcStatusError, StatusCode
from router.http.upstream.exceptions import LocalShortage

logger = logging.getLogger("router.engines.kv_events")

SUBSCRIBE_KV_EVENTS = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"
RESUBSCRIBE_MAX_S = 1.0
"""The longest wait before calling again after a stream broke: short, because a view is
known only if the call is made before the restarted engine's first batch (a refused
connect costs next to nothing)."""

REASON_SUBSCRIBING = "subscribing: no batch of this rank seen yet"
REASON_JOINED_LATE = "subscribed after the engine's first batch: blocks cached before are unseen"
REASON_LOST_BATCHES = "batches lost between the engine and the router"
REASON_STREAM_ENDED = "the event stream ended: the engine's cache may change unseen"
REASON_NO_EVENTS = "the engine serves no KV events (SubscribeKvEvents unimplemented)"
REASON_SNAPSHOT_PARTIAL = "the relay's snapshot lacks the engine's first batches"


def _common_messages() -> Any:
    return importlib.import_module("smg_grpc_proto.generated.common_pb2")


@dataclass(frozen=True)
class GrpcKvSource:
    """One `grpc://` worker's event stream, and which of its ranks feed which view."""

    worker_id: str
    url: str
    views: Mapping[int, int | None]
    """The engine's DP rank -> the view's rank (the rank itself for a rank-multiplexed
    worker; the record's `dp_rank`, often None, for a worker that is one rank)."""


@dataclass
class _Rank:
    """What one engine rank's stream has delivered on the current call."""

    last_seq: int = -1
    """The last batch applied; -1 before the rank's first batch on this call."""
    snapshot_partial: bool = False


def to_batch(proto: Any) -> EventBatch:
    """A `KvEventBatch` as the index's events."""
    events: list[KvEvent] = []
    unknown = 0
    for event in proto.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            events.append(_stored(event.stored))
        elif kind == "removed":
            removed = event.removed
            events.append(
                BlockRemoved(
                    block_hashes=list(removed.block_hashes),
                    medium=removed.medium if removed.HasField("medium") else None,
                    group_idx=removed.group_idx if removed.HasField("group_idx") else None,
                )
            )
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            unknown += 1
    return EventBatch(
        ts=proto.timestamp,
        events=events,
        dp_rank=proto.dp_rank if proto.HasField("dp_rank") else None,
        unknown_events=unknown,
    )


def _stored(stored: Any) -> BlockStored:
    blocks = stored.blocks
    token_ids: list[int] = []
    extras: list[ExtraKey | None] = []
    for block in blocks:
        token_ids.extend(block.token_ids)
        extras.append(tuple(_extra(key) for key in block.extra_keys) or None)
    first = blocks[0] if blocks else None
    return BlockStored(
        block_hashes=[block.block_hash for block in blocks],
        parent_block_hash=(
            stored.parent_block_hash if stored.HasField("parent_block_hash") else None
        ),
        token_ids=token_ids,
        # A relay sends one size per batch; a block of another size fails the index's
        # token-count check, which marks the view unknown.
        block_size=first.block_size if first is not None else 0,
        lora_name=stored.lora_name if stored.HasField("lora_name") else None,
        lora_id=first.lora_id if first is not None and first.HasField("lora_id") else None,
        extra_keys=extras if any(extra is not None for extra in extras) else None,
        medium=stored.medium if stored.HasField("medium") else None,
        group_idx=stored.group_idx if stored.HasField("group_idx") else None,
    )


def _extra(key: Any) -> object:
    # As the engine's own tuple arrives over ZMQ: text, bytes, an integer, or a
    # multimodal item as (identifier, offset).
    kind = key.WhichOneof("key")
    if kind == "multimodal":
        return (key.multimodal.identifier, key.multimodal.offset)
    if kind is None:
        return None
    value: object = getattr(key, kind)
    return value


class GrpcKvSubscription:
    """The state of one worker's event stream; `serve` runs it."""

    def __init__(
        self,
        source: GrpcKvSource,
        index: KvIndex,
        pool: GrpcPool,
        settings: SubscriptionSettings | None = None,
    ) -> None:
        self.source = source
        self.index = index
        self.pool = pool
        self.settings = settings or SubscriptionSettings()
        self.view: ViewId = (source.worker_id, None)
        """The key the fleet keeps this subscription under (its views are `views()`)."""
        self._ranks: dict[int, _Rank] = {}
        self._events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self._batches = 0
        self._decode_errors = 0
        self._unknown_event_types = 0
        self._gaps = 0
        self._restarts = 0
        self._connects = 0
        self._disconnects = 0
        self._unknown_views = 0
        self._rank_mismatches = 0
        self._last_seq = -1
        self._batches_this_call = 0
        self._logged_decode_error = False
        self._changed = trio.Event()

    def views(self) -> list[ViewId]:
        return [(self.source.worker_id, rank) for rank in self.source.views.values()]

    def statistics(self) -> SubscriptionStatistics:
        return SubscriptionStatistics(
            events=dict(self._events),
            batches=self._batches,
            decode_errors=self._decode_errors,
            unknown_event_types=self._unknown_event_types,
            replays=0,
            replay_failures=0,
            replayed_batches=0,
            gaps=self._gaps,
            restarts=self._restarts,
            connects=self._connects,
            reconnects=max(0, self._connects - 1),
            disconnects=self._disconnects,
            unknown_views=self._unknown_views,
            rank_mismatches=self._rank_mismatches,
            last_seq=self._last_seq,
        )

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Until `condition()` holds, checked after every batch and every call's end."""
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- the task ----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        settings = self.settings
        delay = settings.retry_initial_s
        task_status.started()
        while True:
            wait = await self._one_call()
            self._notify()
            if wait == "now":
                delay = settings.retry_initial_s
                continue
            if wait == "longest":
                await trio.sleep(settings.retry_max_s)
                continue
            if self._batches_this_call:
                delay = settings.retry_initial_s
            await trio.sleep(delay)
            delay = min(delay * 2, RESUBSCRIBE_MAX_S)

    async def _one_call(self) -> str:
        """One `SubscribeKvEvents` call, read to its end: when to call again (`now`,
        `backoff` or `longest`)."""
        source = self.source
        self._ranks = {}
        self._batches_this_call = 0
        for view in self.views():
            self._unknown(view, REASON_SUBSCRIBING)
        request = _common_messages().SubscribeKvEventsRequest(start_sequence_number=0)
        try:
            async with self.pool.call(
                source.url, SUBSCRIBE_KV_EVENTS, request.SerializeToString()
            ) as call:
                self._connects += 1
                while True:
                    raw = await call.receive_message()
                    if raw is None:
                        break
                    self._on_message(raw)
                    self._notify()
        except GrpcStatusError as exc:
            if exc.code == StatusCode.UNIMPLEMENTED:
                self._stream_ended(REASON_NO_EVENTS, exc, level=logging.INFO)
                return "longest"
            if exc.code == StatusCode.DATA_LOSS:
                # The relay could not keep the stream whole (a publisher restart, a gap
                # it could not replay): start again from nothing.
                self._restarts += 1
                self._stream_ended(REASON_STREAM_ENDED, exc)
                return "now"
            self._stream_ended(REASON_STREAM_ENDED, exc)
            return "backoff"
        except (GrpcError, LocalShortage) as exc:
            self._stream_ended(REASON_STREAM_ENDED, exc)
            return "backoff"
        self._stream_ended(REASON_STREAM_ENDED, None)
        return "backoff"

    def _stream_ended(
        self, reason: str, exc: Exception | None, *, level: int = logging.WARNING
    ) -> None:
        self._disconnects += 1
        logger.log(
            level,
            "kv events: the stream of worker %s (%s) ended: %s; its views are unknown",
            self.source.worker_id,
            self.source.url,
            exc if exc is not None else "the engine closed it",
        )
        for view in self.views():
            self._unknown(view, reason)

    # -- batches -----------------------------------------------------------------------

    def _on_message(self, raw: bytes) -> None:
        messages = _common_messages()
        try:
            proto = messages.KvEventBatch.FromString(raw)
        except Exception as exc:  # protobuf raises its own DecodeError
            self._decode_error(exc)
            return
        engine_rank = proto.dp_rank if proto.HasField("dp_rank") else 0
        if engine_rank not in self.source.views:
            self._rank_mismatches += 1
            return
        view: ViewId = (self.source.worker_id, self.source.views[engine_rank])
        rank = self._ranks.setdefault(engine_rank, _Rank())
        seq = proto.sequence_number
        snapshot = proto.snapshot if proto.HasField("snapshot") else None
        if snapshot is not None:
            self._snapshot_chunk(view, rank, proto, snapshot)
            return
        if seq <= rank.last_seq:
            return  # a load-only record, or a batch already applied
        batch = to_batch(proto)
        if rank.last_seq < 0:
            # The rank's first batch on this call: is everything the engine cached seen?
            self.index.clear_view(view)
            if seq == 0:
                self.index.mark_known(view)
            else:
                self._unknown(view, REASON_JOINED_LATE)
        elif seq > rank.last_seq + 1:
            self._gaps += 1
            self._unknown(view, REASON_LOST_BATCHES)
        rank.last_seq = seq
        self._apply(view, seq, batch)

    def _snapshot_chunk(self, view: ViewId, rank: _Rank, proto: Any, snapshot: Any) -> None:
        # A relay's record of the cache: chunk 0 starts the rebuild; the view is known
        # after the last chunk if the record reaches back to the engine's start.
        if snapshot.index == 0:
            self.index.clear_view(view)
            self.index.mark_unknown(view, REASON_SUBSCRIBING)
            rank.snapshot_partial = snapshot.unknown_before > 0
        rank.last_seq = proto.sequence_number
        self._apply(view, proto.sequence_number, to_batch(proto))
        if snapshot.index + 1 >= snapshot.count:
            if rank.snapshot_partial:
                self._unknown(view, REASON_SNAPSHOT_PARTIAL)
            elif self.index.view_reason(view) == REASON_SUBSCRIBING:
                self.index.mark_known(view)

    def _apply(self, view: ViewId, seq: int, batch: EventBatch) -> None:
        self._batches += 1
        self._batches_this_call += 1
        self._last_seq = max(self._last_seq, seq)
        self._unknown_event_types += batch.unknown_events
        for event in batch.events:
            self._events[type(event).__name__] += 1
        was_unknown = self.index.view_reason(view) is not None
        # An `AllBlocksCleared` makes the view known (the engine's cache is empty, and
        # every later batch is seen); nothing else in a batch does.
        self.index.apply(view, batch.events)
        if was_unknown and self.index.view_reason(view) is None:
            logger.info(
                "kv events: worker %s rank %s cleared its cache; its view is known again",
                self.source.worker_id,
                view[1],
            )

    def _unknown(self, view: ViewId, reason: str) -> None:
        if self.index.view_reason(view) is None:
            self._unknown_views += 1
        self.index.mark_unknown(view, reason)

    def _decode_error(self, exc: Exception) -> None:
        self._decode_errors += 1
        for view in self.views():
            self._unknown(view, "a batch that does not parse: its events are lost")
        if not self._logged_decode_error:
            self._logged_decode_error = True
            logger.warning(
                "kv events: a batch from worker %s (%s) does not parse: %s "
                "(logged once per subscription; every one is counted)",
                self.source.worker_id,
                self.source.url,
                exc,
            )

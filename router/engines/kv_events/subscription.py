"""One subscription to one engine publisher (one worker, one DP rank), feeding the index.

The publisher side, as vLLM implements it (`vllm/distributed/kv_events.py`,
`ZmqEventPublisher`): a PUB socket sends `(topic, seq, payload)` per batch, `seq`
counting from 0 per publisher process; every payload is also kept in an in-memory
deque of the last `buffer_steps` (default 10,000) batches. A ROUTER socket
(`_service_replay`) takes a request of exactly three frames `(identity, b"",
start_seq)` -- so a DEALER sends `[b"", start_seq.to_bytes(8, "big")]` -- and answers
`(identity, b"", topic, seq, payload)` for every buffered batch with `seq >= start_seq`,
in order, then `(identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")`
(vLLM 0.32, observed; earlier releases sent the same without the topic frame, and both
are read here: `replay_frames`). The replay
socket is serviced from the publisher's loop between queue polls of 0.1 s, so an answer
can take that long on an idle engine. Asking from a seq older than the buffer is not an
error: the answer simply starts later, which is how a lost gap is detected here.

Sequence rules (per subscription):
- start (router restart, or a worker joining): replay from 0. An answer that starts at
  seq 0 (or is empty: nothing published yet) rebuilds the view completely: known. One
  that starts later means the buffer wrapped: the view is unknown.
- a gap (seq > last + 1): replay from last + 1; an answer that starts later than that
  leaves the view unknown.
- a restart (seq at or below the last seq *this SUB stream* delivered; batches applied
  from a replay are not counted, so their late live copies are skipped, not taken for a
  restart): the engine's cache died with it, so the view is cleared and rebuilt by a
  replay from 0, as at start.
- a (re)connect of the SUB socket: replay from last + 1, so batches published while the
  subscription was not yet (or no longer) active on the publisher are fetched. That
  is also the answer to ZMQ's slow joiner: a SUB only receives once its subscription
  has reached the PUB, some time after the TCP connect, and nothing tells the
  subscriber when. The replay at start and the one after the connect cover what the
  PUB dropped before; a batch still lost in the remaining window (after the catch-up
  replay was answered, before the subscription took effect) shows as a gap at the next
  batch and is replayed then.
- a lost connection (the SUB socket's monitor reports it): the view is unknown from
  then on, since the publisher's cache may change unseen; the reconnect's replay makes
  it known again (a publisher that never comes back leaves it unknown).
- an undecodable batch whose seq can be read: counted, logged once, and the view is
  unknown (its events are lost; replaying the same bytes would not help).

An unknown view is rebuilt by an `AllBlocksCleared` (the engine's cache is empty, and
every later batch arrives in order), or by an engine restart (a new sequence whose
replay starts at 0). A replay that fails (no answer within the timeout) leaves the view
unknown and is retried with backoff; while it is pending, live batches are not applied
(the retry fetches them from the buffer, in order).

Limitation: an engine that restarts while the subscription is disconnected and
publishes more batches than the old process had before the SUB reconnects is not told
apart by sequence numbers alone; its batches are taken as a continuation, and the old
process's blocks stay in the view until evicted or cleared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from router.engines.kv_events.decode import (
    END_OF_REPLAY_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
    decode_seq,
)
from router.engines.kv_events.index import KvIndex, ViewId
from router.engines.zmq_trio import close_socket, recv_multipart, socket_fd

logger = logging.getLogger("router.engines.kv_events")

REASON_REPLAYING = "replaying the engine's event buffer"
REASON_REPLAY_FAILED = "replay socket did not answer: gap not repaired yet"
REASON_NO_REPLAY = "no replay endpoint: a gap cannot be repaired"
REASON_DISCONNECTED = "publisher disconnected: its cache may change unseen"
# What a successful replay repairs. Any other reason (a lost batch, an event the index
# could not apply) waits for an AllBlocksCleared or a full rebuild from seq 0.
_REPAIRABLE = (REASON_REPLAYING, REASON_REPLAY_FAILED, REASON_DISCONNECTED)
# What the monitor pump sends for a lost connection (None: a connection made).
_DISCONNECTED: list[bytes] = []


def replay_frames(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """The seq and payload frames of one replay answer as a DEALER receives it:
    `(b"", topic, seq, payload)` (vLLM 0.32) or `(b"", seq, payload)` (earlier); None
    for anything else."""
    if len(frames) == 4 and frames[0] == b"":
        return frames[2], frames[3]
    if len(frames) == 3 and frames[0] == b"":
        return frames[1], frames[2]
    return None


@dataclass(frozen=True)
class KvEventSource:
    """Where one worker rank publishes."""

    worker_id: str
    dp_rank: int | None
    endpoint: str
    """The PUB socket, e.g. `tcp://10.0.0.5:5557`."""
    replay_endpoint: str | None
    """The replay ROUTER socket, e.g. `tcp://10.0.0.5:5558`; None when not served."""
    topic: bytes = b""
    """Subscription prefix; vLLM's default topic is empty."""


@dataclass(frozen=True)
class SubscriptionSettings:
    replay_timeout_s: float = 2.0
    """Longest wait for the next frame of a replay answer (the publisher services
    replays every 0.1 s at most)."""
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    receive_hwm: int = 10_000
    """Messages ZMQ queues for a slow subscription before it drops (a gap, repaired)."""
    queue_size: int = 256
    reconnect_max_s: float = 5.0


@dataclass(frozen=True)
class SubscriptionStatistics:
    events: dict[str, int]
    """Events applied, by type (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`)."""
    batches: int
    decode_errors: int
    unknown_event_types: int
    replays: int
    replay_failures: int
    replayed_batches: int
    gaps: int
    restarts: int
    connects: int
    """SUB connections made (each followed by a catch-up replay)."""
    reconnects: int
    disconnects: int
    """Connections to the publisher lost (the view is unknown until the reconnect's
    replay)."""
    unknown_views: int
    """Times this subscription found its view could not be kept whole."""
    rank_mismatches: int
    last_seq: int


@dataclass
class _Counters:
    events: dict[str, int] = field(
        default_factory=lambda: {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    )
    batches: int = 0
    decode_errors: int = 0
    unknown_event_types: int = 0
    replays: int = 0
    replay_failures: int = 0
    replayed_batches: int = 0
    gaps: int = 0
    restarts: int = 0
    connects: int = 0
    reconnects: int = 0
    disconnects: int = 0
    unknown_views: int = 0
    rank_mismatches: int = 0


class _ReplayFailed(Exception):
    pass


class KvSubscription:
    """The state of one subscription; `serve_kv_subscription` runs it."""

    def __init__(
        self,
        source: KvEventSource,
        index: KvIndex,
        settings: SubscriptionSettings | None = None,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.source = source
        self.index = index
        self.settings = settings or SubscriptionSettings()
        self.view: ViewId = (source.worker_id, source.dp_rank)
        self._context = context
        self._counters = _Counters()
        # Last seq applied to the index (from either socket), and the last seq the SUB
        # stream itself delivered (a step back there is an engine restart).
        self._last_applied = -1
        self._last_live = -1
        # Set while a gap waits for a replay that failed: the seq to replay from.
        self._repair_from: int | None = None
        self._retry_at = 0.0
        self._retry_delay = self.settings.retry_initial_s
        self._logged_decode_error = False
        self._changed = trio.Event()

    def statistics(self) -> SubscriptionStatistics:
        c = self._counters
        return SubscriptionStatistics(
            events=dict(c.events),
            batches=c.batches,
            decode_errors=c.decode_errors,
            unknown_event_types=c.unknown_event_types,
            replays=c.replays,
            replay_failures=c.replay_failures,
            replayed_batches=c.replayed_batches,
            gaps=c.gaps,
            restarts=c.restarts,
            connects=c.connects,
            reconnects=c.reconnects,
            disconnects=c.disconnects,
            unknown_views=c.unknown_views,
            rank_mismatches=c.rank_mismatches,
            last_seq=self._last_applied,
        )

    def views(self) -> list[ViewId]:
        return [self.view]

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Until `condition()` holds, checked after every message and replay handled
        (e.g. the view known after the first replay, or a seq applied)."""
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- the task ----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        context = self._context or zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.settings.receive_hwm)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.settings.reconnect_max_s * 1000))
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic)
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            monitor.setsockopt(zmq.LINGER, 0)
            try:
                sub.connect(self.source.endpoint)
            except zmq.ZMQError as exc:
                # A bad endpoint (say, from a worker's record) must not take the fleet
                # down: the view stays unknown, visibly, until the worker leaves.
                logger.error(
                    "kv events: cannot subscribe to worker %s rank %s at %r: %s",
                    self.source.worker_id,
                    self.source.dp_rank,
                    self.source.endpoint,
                    exc,
                )
                self._unknown(f"cannot connect to {self.source.endpoint!r}")
                task_status.started()
                await trio.sleep_forever()
            send, receive = trio.open_memory_channel[list[bytes] | None](self.settings.queue_size)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump_messages, sub, send.clone())
                nursery.start_soon(_pump_connects, monitor, send)
                task_status.started()
                await self._process(receive)
        finally:
            if monitor is not None:
                sub.disable_monitor()
                close_socket(monitor)
            close_socket(sub)

    async def _process(self, receive: trio.MemoryReceiveChannel[list[bytes] | None]) -> None:
        # A router (re)start and a worker joining are the same case: all we know is in
        # the engine's replay buffer.
        await self._replay(0)
        self._notify()
        nothing: list[bytes] = []
        while True:
            item: list[bytes] | None = nothing
            if self._repair_from is not None and self.source.replay_endpoint is not None:
                with trio.move_on_at(self._retry_at):
                    item = await receive.receive()
                if item is nothing:
                    await self._replay(self._repair_from)
                    self._notify()
                    continue
            else:
                item = await receive.receive()
            if item is None:
                await self._on_connected()
            elif item is _DISCONNECTED:
                self._on_disconnected()
            else:
                await self._on_message(item)
            self._notify()

    async def _on_connected(self) -> None:
        if self._counters.connects > 0:
            self._counters.reconnects += 1
            logger.info(
                "kv events: reconnected to worker %s rank %s (%s); replaying from seq %d",
                self.source.worker_id,
                self.source.dp_rank,
                self.source.endpoint,
                self._last_applied + 1,
            )
        if self._repair_from is None:
            await self._replay(self._last_applied + 1)
        self._counters.connects += 1

    def _on_disconnected(self) -> None:
        # The publisher is gone (an engine killed, a network cut): whatever its cache does
        # now is not seen, so the view is not read until the reconnect's replay repairs it.
        self._counters.disconnects += 1
        logger.warning(
            "kv events: lost the publisher of worker %s rank %s (%s); its view is unknown",
            self.source.worker_id,
            self.source.dp_rank,
            self.source.endpoint,
        )
        self._unknown(REASON_DISCONNECTED)

    async def _on_message(self, frames: list[bytes]) -> None:
        seq: int | None = None
        batch: EventBatch | None = None
        try:
            if len(frames) != 3:
                raise DecodeError(f"message of {len(frames)} frames, expected 3")
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except DecodeError as exc:
            self._decode_error(exc, seq)
            if seq is None:
                return  # no sequence to account for: nothing else to do
        assert seq is not None
        if seq <= self._last_live:
            self._counters.restarts += 1
            logger.warning(
                "kv events: worker %s rank %s restarted (seq %d after %d); rebuilding its view",
                self.source.worker_id,
                self.source.dp_rank,
                seq,
                self._last_live,
            )
            self.index.clear_view(self.view)
            self._last_applied = -1
            self._repair_from = None
            await self._replay(0)
        self._last_live = seq
        if seq <= self._last_applied or self._repair_from is not None:
            return  # applied from a replay already, or a repair will fetch it
        if seq > self._last_applied + 1:
            self._counters.gaps += 1
            await self._replay(self._last_applied + 1)
            if seq <= self._last_applied or self._repair_from is not None:
                return
            if seq > self._last_applied + 1:
                # The replay did not reach this far (nothing can be fetched: no replay
                # socket, or it lost the batches): the view was marked; move on.
                self._last_applied = seq - 1
        self._apply(seq, batch)

    # -- replay ------------------------------------------------------------------------

    async def _replay(self, start: int) -> None:
        """Fetch and apply the buffered batches from `start`. From 0 it rebuilds the view.

        Cancellation: the replay socket is closed; batches applied so far stay applied.
        """
        endpoint = self.source.replay_endpoint
        rebuild = start == 0
        if rebuild:
            self.index.mark_unknown(self.view, REASON_REPLAYING)
            self._last_applied = -1
        if endpoint is None:
            self._unknown(REASON_NO_REPLAY)
            return
        self._counters.replays += 1
        context = self._context or zmq.Context.instance()
        dealer = context.socket(zmq.DEALER)
        first = True
        try:
            try:
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(endpoint)
                dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise _ReplayFailed(f"cannot send to {endpoint}: {exc}") from None
            fd = socket_fd(dealer)
            while True:
                frames: list[bytes] | None = None
                with trio.move_on_after(self.settings.replay_timeout_s):
                    frames = await recv_multipart(dealer, fd)
                if frames is None:
                    raise _ReplayFailed(f"no answer within {self.settings.replay_timeout_s:.1f}s")
                parts = replay_frames(frames)
                if parts is None:
                    self._decode_error(
                        DecodeError("replay frame is not (b'', [topic,] seq, payload)"), None
                    )
                    continue
                seq_frame, payload = parts
                if seq_frame == END_OF_REPLAY_SEQ:
                    break
                try:
                    seq = decode_seq(seq_frame)
                except DecodeError as exc:
                    self._decode_error(exc, None)
                    continue
                if first and rebuild:
                    self.index.clear_view(self.view)
                first = False
                if seq <= self._last_applied:
                    continue
                if seq > self._last_applied + 1:
                    # The buffer no longer holds what we missed.
                    self._unknown(
                        "replay buffer no longer reaches seq 0"
                        if self._last_applied < 0
                        else f"replay buffer lost seqs {self._last_applied + 1}..{seq - 1}"
                    )
                try:
                    batch: EventBatch | None = decode_batch(payload)
                except DecodeError as exc:
                    self._decode_error(exc, seq)
                    batch = None
                self._apply(seq, batch)
                self._counters.replayed_batches += 1
        except _ReplayFailed as exc:
            self._counters.replay_failures += 1
            logger.warning(
                "kv events: replay from worker %s rank %s (%s) failed: %s; "
                "its view is unknown, retrying in %.1fs",
                self.source.worker_id,
                self.source.dp_rank,
                endpoint,
                exc,
                self._retry_delay,
            )
            self._unknown(REASON_REPLAY_FAILED)
            self._repair_from = self._last_applied + 1
            self._retry_at = trio.current_time() + self._retry_delay
            self._retry_delay = min(self._retry_delay * 2, self.settings.retry_max_s)
            return
        finally:
            close_socket(dealer)
        if first and rebuild:
            # Nothing buffered: the engine has not published anything; its cache is empty.
            self.index.clear_view(self.view)
        self._repair_from = None
        self._retry_delay = self.settings.retry_initial_s
        # Known again only if nothing else went wrong meanwhile.
        reason = self.index.view_reason(self.view)
        if reason in (REASON_REPLAY_FAILED, REASON_DISCONNECTED) or (
            rebuild and reason == REASON_REPLAYING
        ):
            self.index.mark_known(self.view)

    # -- applying ----------------------------------------------------------------------

    def _apply(self, seq: int, batch: EventBatch | None) -> None:
        self._last_applied = seq
        if batch is None:
            self._unknown(f"batch {seq} could not be decoded")
            return
        c = self._counters
        c.batches += 1
        c.unknown_event_types += batch.unknown_events
        if (
            batch.dp_rank is not None
            and self.source.dp_rank is not None
            and batch.dp_rank != self.source.dp_rank
        ):
            c.rank_mismatches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                c.events["BlockStored"] += 1
            elif isinstance(event, BlockRemoved):
                c.events["BlockRemoved"] += 1
            elif isinstance(event, AllBlocksCleared):
                c.events["AllBlocksCleared"] += 1
        self.index.apply(self.view, batch.events)

    def _unknown(self, reason: str) -> None:
        current = self.index.view_reason(self.view)
        if current not in (None, *_REPAIRABLE) and reason in _REPAIRABLE:
            # A loss no replay can undo stays the reason: a successful retry of a later
            # replay must not make this view known again.
            return
        if current in (None, REASON_REPLAYING):
            self._counters.unknown_views += 1
        self.index.mark_unknown(self.view, reason)

    def _decode_error(self, exc: DecodeError, seq: int | None) -> None:
        self._counters.decode_errors += 1
        if not self._logged_decode_error:
            self._logged_decode_error = True
            logger.warning(
                "kv events: undecodable message from worker %s rank %s (%s), seq %s: %s "
                "(logged once per subscription; every one is counted)",
                self.source.worker_id,
                self.source.dp_rank,
                self.source.endpoint,
                "unknown" if seq is None else seq,
                exc,
            )


async def serve_kv_subscription(
    subscription: KvSubscription,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep `subscription.index` in step with one publisher until cancelled. Reports
    `started()` once the SUB socket is connecting; the first replay follows.

    Cancellation: every socket is closed (linger 0); the index keeps what was applied
    (the fleet calls `forget_worker` when the worker leaves).
    """
    await subscription.serve(task_status=task_status)


async def _pump_messages(
    sub: zmq.Socket[bytes], send: trio.MemorySendChannel[list[bytes] | None]
) -> None:
    fd = socket_fd(sub)
    async with send:
        while True:
            await send.send(await recv_multipart(sub, fd))


async def _pump_connects(
    monitor: zmq.Socket[bytes], send: trio.MemorySendChannel[list[bytes] | None]
) -> None:
    fd = socket_fd(monitor)
    async with send:
        while True:
            frames = await recv_multipart(monitor, fd)
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                await send.send(None)
            elif event == zmq.EVENT_DISCONNECTED:
                await send.send(_DISCONNECTED)

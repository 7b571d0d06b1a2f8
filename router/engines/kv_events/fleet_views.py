"""The fleet's side of the KV events: one subscription per worker rank while the worker is
in the fleet, each feeding its model's index.

`serve_kv_events` keeps the set of running subscriptions equal to what the fleet asks
for: a worker that joins with endpoints (its record's `kv_event_sources`, learned from
the engine's `/kv_event_sources`, else the static `--kv-events-port` on the worker's
own host, one port per DP rank: port + rank) gets one `serve_kv_subscription` per rank;
a worker that leaves, or whose endpoints change, has its subscriptions cancelled, and
one that leaves is dropped from the index (`KvIndex.forget_worker`).

A worker's ranks feed the index of its first served model: the engine's blocks do not
depend on which of its model names (a LoRA adapter is keyed by name inside the block
key) a request used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import trio

from router.engines.kv_events.grpc_subscription import GrpcKvSource, GrpcKvSubscription
from router.engines.kv_events.index import IndexSettings, KvIndex, ViewId
from router.engines.kv_events.subscription import (
    KvEventSource,
    KvSubscription,
    SubscriptionSettings,
)
from router.fleet.registry import Fleet, Worker
from router.http.grpc import GrpcPool

logger = logging.getLogger("router.engines.kv_events")


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    port: int = 0
    """The static publisher port on each worker's own host (rank r at port + r); 0: none
    (only workers whose records name their endpoints are subscribed to)."""
    replay_port: int = 0
    """The static replay port (rank r at replay_port + r); 0: no replay socket."""
    reconcile_s: float = 0.2
    """How often the fleet's change counter is read (an integer compare when nothing
    changed) to start and stop subscriptions."""
    subscription: SubscriptionSettings = field(default_factory=SubscriptionSettings)
    index: IndexSettings = field(default_factory=IndexSettings)


class KvIndexes:
    """One `KvIndex` per model, shared by the subscriptions (writers) and the policy
    (reader)."""

    def __init__(self, settings: IndexSettings | None = None) -> None:
        self.settings = settings or IndexSettings()
        self._by_model: dict[str, KvIndex] = {}

    def get(self, model: str) -> KvIndex | None:
        return self._by_model.get(model)

    def for_model(self, model: str) -> KvIndex:
        index = self._by_model.get(model)
        if index is None:
            index = self._by_model[model] = KvIndex(self.settings)
        return index

    def items(self) -> Iterator[tuple[str, KvIndex]]:
        return iter(list(self._by_model.items()))

    def forget_worker(self, worker_id: str) -> None:
        for index in self._by_model.values():
            index.forget_worker(worker_id)


EventSource = KvEventSource | GrpcKvSource
"""A ZMQ publisher (one worker rank) or a `grpc://` worker's event stream (all its
ranks)."""


def worker_sources(worker: Worker, settings: KvEventsSettings) -> tuple[EventSource, ...]:
    """Where `worker`'s ranks publish: its record's endpoints; else a `grpc://` worker's
    own `SubscribeKvEvents`; else the static ports on its own host; none when neither is
    known. (A record's ZMQ endpoints win over the gRPC stream: their replay reaches back
    to the engine's first batch, the stream does not.) The view's rank is the rank for a
    rank-multiplexed worker, the record's own `dp_rank` otherwise."""
    record = worker.record
    multiplexed = record.rank_multiplexed

    def view_rank(rank: int) -> int | None:
        return rank if multiplexed else record.dp_rank

    if record.is_grpc and not record.kv_event_sources:
        ranks = range(record.dp_size) if multiplexed else [record.dp_rank or 0]
        views = {rank: view_rank(rank) for rank in ranks}
        return (GrpcKvSource(worker_id=record.id, url=record.url, views=views),)
    if record.kv_event_sources:
        return tuple(
            KvEventSource(
                worker_id=record.id,
                dp_rank=view_rank(source.dp_rank),
                endpoint=source.endpoint,
                replay_endpoint=source.replay_endpoint,
                topic=source.topic.encode(),
            )
            for source in record.kv_event_sources
            if multiplexed or source.dp_rank == (record.dp_rank or 0)
        )
    if settings.port <= 0:
        return ()
    host = urlsplit(record.url).hostname
    if not host:
        return ()
    if ":" in host:
        host = f"[{host}]"
    ranks = range(record.dp_size) if multiplexed else [record.dp_rank or 0]
    return tuple(
        KvEventSource(
            worker_id=record.id,
            dp_rank=view_rank(rank),
            endpoint=f"tcp://{host}:{settings.port + rank}",
            replay_endpoint=(
                f"tcp://{host}:{settings.replay_port + rank}" if settings.replay_port > 0 else None
            ),
        )
        for rank in ranks
    )


@dataclass
class _Running:
    source: EventSource
    model: str
    subscription: KvSubscription | GrpcKvSubscription
    scope: trio.CancelScope


@dataclass(frozen=True, slots=True)
class KvEventsStatistics:
    subscriptions: int
    events: dict[str, int]
    batches: int
    decode_errors: int
    unknown_event_types: int
    replays: int
    replay_failures: int
    gaps: int
    restarts: int
    reconnects: int
    disconnects: int
    unknown_views: int


_SUMMED = (
    "batches",
    "decode_errors",
    "unknown_event_types",
    "replays",
    "replay_failures",
    "gaps",
    "restarts",
    "reconnects",
    "disconnects",
    "unknown_views",
)


class KvEvents:
    """The running subscriptions of a fleet; `statistics()` sums them, counting those
    that ended too (the counters never go back)."""

    def __init__(
        self,
        fleet: Fleet,
        indexes: KvIndexes,
        settings: KvEventsSettings,
        grpc_pool: GrpcPool | None = None,
    ) -> None:
        self.fleet = fleet
        self.grpc_pool = grpc_pool
        """Where a `grpc://` worker's event stream is opened; None: such workers are not
        subscribed to (their views stay unknown)."""
        self.indexes = indexes
        self.settings = settings
        self._running: dict[ViewId, _Running] = {}
        self._retired: dict[str, int] = dict.fromkeys(_SUMMED, 0)
        self._retired_events: dict[str, int] = {}
        self._departed: list[str] = []
        self._seen_generation = -1

    def subscription(self, view: ViewId) -> KvSubscription | GrpcKvSubscription | None:
        running = self._running.get(view)
        return None if running is None else running.subscription

    def statistics(self) -> KvEventsStatistics:
        totals = dict(self._retired)
        events = dict(self._retired_events)
        for running in self._running.values():
            stats = running.subscription.statistics()
            for name in _SUMMED:
                totals[name] += getattr(stats, name)
            for kind, count in stats.events.items():
                events[kind] = events.get(kind, 0) + count
        return KvEventsStatistics(subscriptions=len(self._running), events=events, **totals)

    # -- FleetListener -----------------------------------------------------------------

    def worker_left(self, worker: Worker) -> None:
        self._departed.append(worker.id)

    def url_dropped(self, url: str) -> None:
        """Nothing here is kept per URL."""

    # -- reconciling -------------------------------------------------------------------

    def reconcile(self, nursery: trio.Nursery) -> None:
        """Start what the fleet asks for and is not running; cancel what it no longer
        asks for. O(workers), run only when the fleet changed."""
        departed, self._departed = self._departed, []
        if departed == [] and self.fleet.generation == self._seen_generation:
            return
        self._seen_generation = self.fleet.generation
        wanted: dict[ViewId, tuple[EventSource, str]] = {}
        for worker in self.fleet.workers():
            if not worker.record.models:
                continue
            model = worker.record.models[0]
            for source in worker_sources(worker, self.settings):
                if isinstance(source, GrpcKvSource):
                    if self.grpc_pool is not None:
                        wanted[(source.worker_id, None)] = (source, model)
                else:
                    wanted[(source.worker_id, source.dp_rank)] = (source, model)
        for view, running in list(self._running.items()):
            want = wanted.get(view)
            if want is None or want != (running.source, running.model):
                self._stop(view, running)
        present = {worker.id for worker in self.fleet.workers()}
        for worker_id in departed:
            if worker_id not in present:
                self.indexes.forget_worker(worker_id)
        for view, (source, model) in wanted.items():
            if view not in self._running:
                self._start(nursery, source, model)

    def _start(self, nursery: trio.Nursery, source: EventSource, model: str) -> None:
        index = self.indexes.for_model(model)
        subscription: KvSubscription | GrpcKvSubscription
        if isinstance(source, GrpcKvSource):
            assert self.grpc_pool is not None
            subscription = GrpcKvSubscription(
                source, index, self.grpc_pool, self.settings.subscription
            )
            logger.info(
                "kv events: subscribing to worker %s over gRPC at %s (ranks %s)",
                source.worker_id,
                source.url,
                sorted(source.views),
            )
        else:
            subscription = KvSubscription(source, index, self.settings.subscription)
            logger.info(
                "kv events: subscribing to worker %s rank %s at %s (replay %s)",
                source.worker_id,
                source.dp_rank,
                source.endpoint,
                source.replay_endpoint,
            )
        scope = trio.CancelScope()
        self._running[subscription.view] = _Running(source, model, subscription, scope)
        nursery.start_soon(_run_subscription, subscription, scope)

    def _stop(self, view: ViewId, running: _Running) -> None:
        running.scope.cancel()
        del self._running[view]
        stats = running.subscription.statistics()
        for name in _SUMMED:
            self._retired[name] += getattr(stats, name)
        for kind, count in stats.events.items():
            self._retired_events[kind] = self._retired_events.get(kind, 0) + count
        # The views are not read again until a new subscription rebuilds them.
        for each in running.subscription.views():
            running.subscription.index.mark_unknown(each, "not subscribed")


async def _run_subscription(
    subscription: KvSubscription | GrpcKvSubscription, scope: trio.CancelScope
) -> None:
    with scope:
        await subscription.serve()


async def serve_kv_events(
    events: KvEvents, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Keep one subscription per worker rank of `events.fleet` running until cancelled.
    Reports `started()` once the subscriptions of the fleet as it is are started.

    Cancellation: every subscription's sockets are closed; the indexes keep what they
    hold (the next router start rebuilds them from the engines' replay buffers).
    """
    events.fleet.add_listener(events)
    async with trio.open_nursery() as nursery:
        events.reconcile(nursery)
        task_status.started()
        while True:
            await trio.sleep(events.settings.reconcile_s)
            events.reconcile(nursery)

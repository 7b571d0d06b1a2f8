"""The fleet registry and the router's own load accounting.

A `Worker` is the router's live view of a `WorkerRecord` (`router.fleet.records`): the
record plus health, in-flight counts, the engine's own load (`router.fleet.load`), its
LoRA adapters (`router.fleet.adapters`) and breaker. Only discovery replaces a record;
only the health checker writes `healthy`; only the engine load reader
(`router.engines.load_reader`) writes the engine's share and adapter slots; the adapters
the engine holds change through the `Fleet` (its model list read, a routing miss), which
indexes workers by model and by adapter and tells its listeners when one leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from router.fleet.adapters import WorkerAdapters
from router.fleet.load import EngineShare, figure
from router.fleet.records import (
    BLOCKING_FACTS,
    PendingWorker,
    Role,
    Status,
    WorkerRecord,
    fill_facts,
)

if TYPE_CHECKING:
    from router.fleet.breaker import CircuitBreaker


@dataclass(eq=False, slots=True)
class Worker:
    """The router's live view of one worker: record, health, load and breaker."""

    record: WorkerRecord
    breaker: CircuitBreaker | None = None
    healthy: bool = True
    inflight: int = 0
    rank_inflight: list[int] = field(default_factory=list)
    departed: bool = False
    """It left the fleet; requests already in flight to it finish."""
    max_inflight: int = 0
    """Requests this router may have in flight on the worker (per DP rank when the router
    picks ranks); 0 means no cap. A worker at its cap is not a candidate."""
    shares: list[EngineShare] = field(default_factory=list)
    """The engine's own load beyond this process, one per view (per DP rank when the
    router picks ranks, else one); empty when engine load is not read."""
    adapters: WorkerAdapters = field(default_factory=WorkerAdapters)
    """The LoRA adapters it holds, and its engine's adapter slots."""

    def __post_init__(self) -> None:
        if not self.rank_inflight:
            self.rank_inflight = [0] * self.record.dp_size
        self.adapters.declare(self.record.adapters, _first_model(self.record))

    def keep_engine_shares(self) -> None:
        """Keep one engine share per view, so readings have somewhere to land."""
        views = self.record.dp_size if self.record.rank_multiplexed else 1
        kept = self.shares[:views]
        self.shares = kept + [EngineShare() for _ in range(views - len(kept))]

    @property
    def load(self) -> float:
        """The load policies compare (`router.fleet.load.figure`): the engine's count
        beyond this process plus this process's own in flight; only the latter while any
        view's reading is unknown."""
        shares = self.shares
        if not shares:
            return float(self.inflight)
        if len(shares) == 1:
            return figure(shares[0].others, self.inflight)
        others = 0.0
        for share in shares:
            if share.others is None:
                return float(self.inflight)
            others += share.others
        return others + self.inflight

    def engine_share(self) -> tuple[float, float] | None:
        """What the engine holds beyond this process (summed over the views) and when the
        oldest reading behind it was taken; None while any view is unknown or no reading
        is kept."""
        others = 0.0
        oldest: float | None = None
        for share in self.shares:
            if share.others is None or share.read_at is None:
                return None
            others += share.others
            oldest = share.read_at if oldest is None else min(oldest, share.read_at)
        return None if oldest is None else (others, oldest)

    def rank_load(self, rank: int) -> float:
        """The load of one DP rank of a rank-multiplexed worker, as `load` is of a worker."""
        own = self.rank_inflight[rank]
        shares = self.shares
        if rank < len(shares) and len(shares) > 1:
            return figure(shares[rank].others, own)
        return float(own)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def role(self) -> Role:
        return self.record.role

    @property
    def engine(self) -> str | None:
        """The engine's kind: as the record names it, or as the engine showed it; None
        while unknown."""
        return self.record.engine

    @property
    def draining(self) -> bool:
        return self.record.status is Status.DRAINING

    @property
    def full(self) -> bool:
        """At its in-flight cap: every rank at the cap when the router picks the rank."""
        cap = self.max_inflight
        if not cap:
            return False
        if self.record.rank_multiplexed:
            return min(self.rank_inflight) >= cap
        return self.inflight >= cap

    def begin(self, rank: int | None = None, now: float | None = None) -> None:
        """Count one request in flight (and on `rank` when the router chose it), sent at
        `now` (the engine share needs the time to tell which readings can count it)."""
        self.inflight += 1
        if rank is not None:
            self.rank_inflight[rank] += 1
        if self.shares and now is not None:
            self.shares[rank if rank is not None and rank < len(self.shares) else 0].dispatched(now)

    def end(self, rank: int | None = None, sent_at: float | None = None) -> None:
        """One request sent at `sent_at` (on `rank`) ended."""
        self.inflight -= 1
        if rank is not None and rank < len(self.rank_inflight):
            self.rank_inflight[rank] -= 1
        if self.shares and sent_at is not None:
            self.shares[rank if rank is not None and rank < len(self.shares) else 0].ended(sent_at)


def _first_model(record: WorkerRecord) -> str | None:
    return record.models[0] if record.models else None


BreakerFactory = Callable[[str], "CircuitBreaker | None"]


class FleetListener(Protocol):
    """Told when the fleet lets go of something, so per-worker state elsewhere can go too."""

    def worker_left(self, worker: Worker) -> None:
        """`worker` left the fleet (it may have requests in flight still)."""

    def url_dropped(self, url: str) -> None:
        """No worker in the fleet has `url` any more, and no request is in flight to it."""


class Fleet:
    """Every known worker by id, with an index by model kept current on each change.

    Changes (discovery events) are rare and requests are many, so the per-model lists are
    rebuilt on change and read without any scan per request.

    With a `clock`, the fleet remembers for `model_memory_s` when each model lost its last
    worker (`last_served_at`), so a briefly empty fleet is not mistaken for an unknown
    model. Listeners hear of departures (`FleetListener`); a URL is reported dropped only
    once the last request in flight to it has ended (`lease_ended`).
    """

    def __init__(
        self,
        breaker_factory: BreakerFactory | None = None,
        *,
        model_memory_s: float = 0.0,
        clock: Callable[[], float] | None = None,
        max_inflight: int = 0,
        engine_shares: bool = False,
    ) -> None:
        self._breaker_factory = breaker_factory or (lambda _worker_id: None)
        self._max_inflight = max_inflight
        self.engine_shares = engine_shares
        """Whether workers keep engine shares (an engine load reader runs)."""
        self._workers: dict[str, Worker] = {}
        self._by_model: dict[str, list[Worker]] = {}
        self._base_models: list[str] = []
        self._adapter_parents: dict[str, str] = {}
        self._urls: set[str] = set()
        self._model_memory_s = model_memory_s
        self._clock = clock
        self._models_gone_at: dict[str, float] = {}
        self._listeners: list[FleetListener] = []
        self._url_holders: dict[str, Worker] = {}
        """URLs no worker has any more, each with the worker whose requests still use it."""
        self.generation = 0
        """Bumped on every change, so caches keyed on the fleet know when to refresh."""
        self.pending: dict[str, PendingWorker] = {}
        """Workers held out of the fleet until their facts are learned, by id."""
        self.describing: dict[str, WorkerRecord] = {}
        """Workers in routing whose descriptive facts (engine kind, ...) are still to be
        asked, by id: the record as discovery gave it, facts learned so far filled in."""
        self.on_pending: Callable[[], None] | None = None
        """Called when a worker starts waiting for its facts, or routes while its
        descriptive facts are asked (the facts service listens)."""
        self._learned: dict[str, WorkerRecord] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def add_listener(self, listener: FleetListener) -> None:
        self._listeners.append(listener)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def models(self) -> list[str]:
        """The base models served (sorted); adapters are `adapters()`."""
        return self._base_models

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter some worker holds, with the base model it applies to."""
        return self._adapter_parents

    def adapter_parent(self, name: str) -> str | None:
        """The base model of adapter `name`; None when no worker holds an adapter so named."""
        return self._adapter_parents.get(name)

    def for_model(self, model: str) -> list[Worker]:
        """Workers of every role and status registered for `model`, or holding the LoRA
        adapter of that name (empty when none)."""
        return self._by_model.get(model, [])

    def learn_adapters(self, worker: Worker, listed: Mapping[str, str]) -> None:
        """`worker`'s engine lists the adapters `listed` (name -> base model) now."""
        if worker.adapters.learn(listed) and self._workers.get(worker.id) is worker:
            self._reindex()

    def adapter_missed(self, worker: Worker, adapter: str) -> None:
        """`worker`'s engine answered 404 for `adapter`: it is planned elsewhere from now on."""
        if worker.adapters.miss(adapter) and self._workers.get(worker.id) is worker:
            self._reindex()

    def last_served_at(self, model: str) -> float | None:
        """When `model` lost its last worker, if that was within `model_memory_s`; None for
        a model never served, forgotten, or served now (then `for_model` is not empty)."""
        return self._models_gone_at.get(model)

    def remembered_models(self, now: float) -> int:
        """Models with no worker that are still known (503, not 404) at `now`."""
        oldest_kept = now - self._model_memory_s
        return sum(1 for gone_at in self._models_gone_at.values() if gone_at > oldest_kept)

    def upsert(self, record: WorkerRecord) -> Worker | None:
        """Add a worker or replace its record, keeping live state (load, breaker, health).

        A record that leaves facts to the engine takes those learned for the same worker
        at the same URL; when a fact routing needs is still unknown, the worker waits in
        `pending` (out of routing) and None is returned. A worker that only lacks
        descriptive facts routes at once and waits in `describing` for them.
        """
        if record.unknown_facts:
            learned = self._learned.get(record.id)
            if learned is not None and learned.url == record.url:
                record = fill_facts(record, learned)
            if record.unknown_facts & BLOCKING_FACTS:
                self._hold(record)
                return None
        self.pending.pop(record.id, None)
        if record.unknown_facts:
            asked_before = self.describing.get(record.id)
            self.describing[record.id] = record
            if asked_before is None and self.on_pending is not None:
                self.on_pending()
        else:
            self.describing.pop(record.id, None)
        worker = self._workers.get(record.id)
        old_url: str | None = None
        if worker is None:
            worker = Worker(
                record=record,
                breaker=self._breaker_factory(record.id),
                max_inflight=self._max_inflight,
            )
            self._workers[record.id] = worker
        else:
            if record.dp_size != worker.record.dp_size:
                # Requests in flight keep their rank's count until they end (see `end`).
                kept = worker.rank_inflight[: record.dp_size]
                worker.rank_inflight = kept + [0] * (record.dp_size - len(kept))
            if record.url != worker.record.url:
                old_url = worker.record.url
                worker.shares = []  # another engine: what was read of the old one is not its
                worker.adapters = WorkerAdapters()
            worker.record = record
            worker.adapters.declare(record.adapters, _first_model(record))
        if self.engine_shares:
            worker.keep_engine_shares()
        self._reindex()
        if old_url is not None:
            self._drop_url(old_url, worker)
        return worker

    def admit(self, offered: WorkerRecord, learned: WorkerRecord) -> Worker | None:
        """The facts service learned `offered`'s facts (`learned` is complete): the worker
        joins, unless discovery replaced or removed `offered` meanwhile (None then)."""
        pending = self.pending.get(offered.id)
        if pending is None or pending.record != offered:
            return None
        self._learned[offered.id] = learned
        return self.upsert(offered)

    def describe(self, asked: WorkerRecord, learned: WorkerRecord) -> Worker | None:
        """The facts service learned descriptive facts of `asked` (from `describing`): the
        worker's record takes them, unless discovery replaced or removed it meanwhile."""
        if self.describing.get(asked.id) != asked:
            return None
        # `asked` carries the blocking facts learned before, so `learned` does too.
        self._learned[asked.id] = learned
        return self.upsert(asked)

    def _hold(self, record: WorkerRecord) -> None:
        previous = self.pending.get(record.id)
        if previous is None or previous.record.url != record.url:
            self.pending[record.id] = PendingWorker(record)
        else:
            previous.record = record
        self.describing.pop(record.id, None)
        held_back = self._workers.pop(record.id, None)
        if held_back is not None:
            # Out of routing until its new facts are known: what it left elsewhere goes.
            self._reindex()
            self._departed([held_back])
        if self.on_pending is not None:
            self.on_pending()

    def remove(self, worker_id: str) -> Worker | None:
        self.pending.pop(worker_id, None)
        self.describing.pop(worker_id, None)
        self._learned.pop(worker_id, None)
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._reindex()
            self._departed([worker])
        return worker

    def replace_all(self, records: Iterable[WorkerRecord]) -> None:
        """Make the fleet exactly `records` (a relist), keeping live state of survivors."""
        records = list(records)
        keep = {record.id for record in records}
        gone = [worker for worker_id, worker in self._workers.items() if worker_id not in keep]
        for worker in gone:
            del self._workers[worker.id]
        tables: tuple[dict[str, PendingWorker] | dict[str, WorkerRecord], ...] = (
            self.pending,
            self.describing,
            self._learned,
        )
        for table in tables:
            for worker_id in [wid for wid in table if wid not in keep]:
                del table[worker_id]
        for record in records:
            self.upsert(record)
        self._reindex()
        self._departed(gone)

    def lease_ended(self, worker: Worker) -> None:
        """A request to `worker` ended: if it was the last one on a URL the fleet dropped,
        report that URL now. O(1) unless URLs are waiting for their requests to end."""
        if worker.inflight or not self._url_holders:
            return
        for url in [url for url, holder in self._url_holders.items() if holder is worker]:
            del self._url_holders[url]
            if url not in self._urls:
                for listener in self._listeners:
                    listener.url_dropped(url)

    def _departed(self, workers: list[Worker]) -> None:
        for worker in workers:
            worker.departed = True
            for listener in self._listeners:
                listener.worker_left(worker)
            self._drop_url(worker.url, worker)

    def _drop_url(self, url: str, holder: Worker) -> None:
        if url in self._urls:
            return  # another worker (or this one again) still has it
        if holder.inflight:
            self._url_holders[url] = holder
            return
        for listener in self._listeners:
            listener.url_dropped(url)

    def _reindex(self) -> None:
        by_model: dict[str, list[Worker]] = {}
        parents: dict[str, str] = {}
        for worker in self._workers.values():
            for model in worker.record.models:
                by_model.setdefault(model, []).append(worker)
        base_models = sorted(by_model)
        for worker in self._workers.values():
            for adapter, parent in worker.adapters.held.items():
                holders = by_model.setdefault(adapter, [])
                if worker not in holders:
                    holders.append(worker)
                parents.setdefault(adapter, parent)
        self._remember_models(self._by_model, by_model)
        self._by_model = by_model
        self._base_models = base_models
        self._adapter_parents = {adapter: parent for adapter, parent in sorted(parents.items())}
        self._urls = {worker.url for worker in self._workers.values()}
        self.generation += 1

    def _remember_models(
        self, before: dict[str, list[Worker]], after: dict[str, list[Worker]]
    ) -> None:
        if self._clock is None or self._model_memory_s <= 0:
            return
        now = self._clock()
        for model in before.keys() - after.keys():
            self._models_gone_at[model] = now
        if self._models_gone_at:
            oldest_kept = now - self._model_memory_s
            self._models_gone_at = {
                model: gone_at
                for model, gone_at in self._models_gone_at.items()
                if model not in after and gone_at > oldest_kept
            }

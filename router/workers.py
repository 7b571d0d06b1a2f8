"""Worker records, the fleet registry and the router's own load accounting.

A `WorkerRecord` is what discovery knows about a worker (static flags, a fleet file or an
etcd key). A `Worker` is the router's live view of it: the record plus health, in-flight
counts and breaker. Only discovery replaces a record; only the health checker writes
`healthy`; nothing in the router ever writes `status` (the worker's own registration does).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from router.http.worker_url import InvalidWorkerUrl, parse_worker_url

if TYPE_CHECKING:
    from router.breaker import CircuitBreaker

_E = TypeVar("_E", bound=enum.StrEnum)

MAX_DP_SIZE = 4096
"""Largest `dp_size` a record may claim: the router keeps one counter per rank."""


class Role(enum.StrEnum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Status(enum.StrEnum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"


class InvalidWorkerRecord(ValueError):
    """A worker record that cannot be used; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    id: str
    url: str
    models: tuple[str, ...] = ()
    role: Role = Role.MIXED
    engine: str = "sglang"
    dp_size: int = 1
    dp_rank: int | None = None
    disagg_meta: dict[str, Any] | None = None
    status: Status = Status.ACTIVE
    unknown_facts: frozenset[str] = frozenset()
    """Facts the record leaves to the engine (`FACTS`): the worker joins the fleet once
    they are learned (router.engine_facts); until then it is pending."""
    api_key: str | None = field(default=None, repr=False)
    """The key the router sends this worker (`Authorization: Bearer`); never listed back."""

    @property
    def rank_multiplexed(self) -> bool:
        """The router picks the DP rank (header `X-Data-Parallel-Rank`) for this worker."""
        return self.dp_size > 1 and self.dp_rank is None

    @property
    def bootstrap_addr(self) -> str | None:
        """`host:port` a decode pulls this prefill's KV cache from, when advertised."""
        if not self.disagg_meta:
            return None
        params = self.disagg_meta.get("params") or {}
        addr = params.get("bootstrap_addr")
        return addr if isinstance(addr, str) else None

    @classmethod
    def from_json(cls, data: Any) -> WorkerRecord:
        """Validate a JSON record (etcd value or fleet-file entry). Unknown fields are ignored."""
        if not isinstance(data, dict):
            raise InvalidWorkerRecord(f"a worker record must be an object, got {type(data).__name__}")
        url = data.get("url")
        if not isinstance(url, str):
            raise InvalidWorkerRecord(f"'url' must be an http:// URL, got {url!r}")
        url = url.rstrip("/")
        try:
            parse_worker_url(url)
        except InvalidWorkerUrl as exc:
            raise InvalidWorkerRecord(str(exc)) from None
        worker_id = data.get("id", url)
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidWorkerRecord(f"'id' must be a non-empty string, got {worker_id!r}")
        raw_models = data.get("model", data.get("models", ()))
        if isinstance(raw_models, str):
            raw_models = (raw_models,)
        if not isinstance(raw_models, list | tuple) or not all(
            isinstance(m, str) and m for m in raw_models
        ):
            raise InvalidWorkerRecord(f"'model' must be a string or a list of strings, got {raw_models!r}")
        role = _enum_field(Role, data.get("role", "mixed"), "role")
        status = _enum_field(Status, str(data.get("status", "ACTIVE")).upper(), "status")
        engine = data.get("engine", "sglang")
        if not isinstance(engine, str):
            raise InvalidWorkerRecord(f"'engine' must be a string, got {engine!r}")
        dp_size = _int_field(data.get("dp_size", 1), "dp_size", minimum=1)
        if dp_size > MAX_DP_SIZE:
            raise InvalidWorkerRecord(f"'dp_size' must be at most {MAX_DP_SIZE}, got {dp_size}")
        raw_rank = data.get("dp_rank")
        dp_rank = None if raw_rank is None else _int_field(raw_rank, "dp_rank", minimum=0)
        if dp_rank is not None and dp_rank >= dp_size:
            raise InvalidWorkerRecord(f"'dp_rank' {dp_rank} must be below 'dp_size' {dp_size}")
        meta = data.get("disagg_meta")
        if meta is not None and not isinstance(meta, dict):
            raise InvalidWorkerRecord(f"'disagg_meta' must be an object, got {meta!r}")
        unknown: frozenset[str] = frozenset()
        params = (meta or {}).get("params")
        if role is Role.PREFILL and not (isinstance(params, dict) and isinstance(params.get("bootstrap_addr"), str)):
            # The engine knows its bootstrap port; its DP size comes with the same answer
            # unless the record gives one.
            unknown = frozenset({"bootstrap_port"} if "dp_size" in data else {"bootstrap_port", "dp_size"})
        api_key = data.get("api_key")
        if api_key is not None and (not isinstance(api_key, str) or not api_key.isprintable() or " " in api_key):
            # The value is a secret: the message does not repeat it.
            raise InvalidWorkerRecord("'api_key' must be a string without spaces or control characters")
        return cls(
            id=worker_id,
            url=url,
            models=tuple(raw_models),
            role=role,
            engine=engine,
            dp_size=dp_size,
            dp_rank=dp_rank,
            disagg_meta=meta,
            status=status,
            unknown_facts=unknown,
            api_key=api_key or None,
        )

    def to_json(self) -> dict[str, Any]:
        """The record as registered; `status` is omitted while ACTIVE, `api_key` always."""
        data: dict[str, Any] = {
            "id": self.id,
            "url": self.url,
            "model": list(self.models),
            "role": self.role.value,
            "engine": self.engine,
            "dp_size": self.dp_size,
            "dp_rank": self.dp_rank,
        }
        if self.disagg_meta is not None:
            data["disagg_meta"] = self.disagg_meta
        if self.status is not Status.ACTIVE:
            data["status"] = self.status.value
        return data


FACTS = ("bootstrap_port", "dp_size", "models")
"""What a record may leave to the engine: a prefill's bootstrap port and the DP size
(`/get_server_info`), the served models (`/v1/models`)."""


def fill_facts(record: WorkerRecord, learned: WorkerRecord) -> WorkerRecord:
    """`record` with each fact it leaves open taken from `learned` (a complete record of
    the same worker); every value `record` gives explicitly stays."""
    changes: dict[str, Any] = {}
    if "bootstrap_port" in record.unknown_facts:
        changes["disagg_meta"] = learned.disagg_meta
    if "dp_size" in record.unknown_facts:
        changes["dp_size"] = learned.dp_size
    if "models" in record.unknown_facts:
        changes["models"] = learned.models
    return dataclasses.replace(record, unknown_facts=frozenset(), **changes)


@dataclass(slots=True)
class PendingWorker:
    """A worker discovery named whose facts are not learned yet, and why not."""

    record: WorkerRecord
    reason: str = "waiting for the engine to state its facts"


def _enum_field(kind: type[_E], value: Any, name: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidWorkerRecord(f"'{name}' must be one of {choices}, got {value!r}") from None


def _int_field(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidWorkerRecord(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


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

    def __post_init__(self) -> None:
        if not self.rank_inflight:
            self.rank_inflight = [0] * self.record.dp_size

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

    def begin(self, rank: int | None = None) -> None:
        """Count one request in flight (and on `rank` when the router chose it)."""
        self.inflight += 1
        if rank is not None:
            self.rank_inflight[rank] += 1

    def end(self, rank: int | None = None) -> None:
        self.inflight -= 1
        if rank is not None and rank < len(self.rank_inflight):
            self.rank_inflight[rank] -= 1


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
    ) -> None:
        self._breaker_factory = breaker_factory or (lambda _worker_id: None)
        self._max_inflight = max_inflight
        self._workers: dict[str, Worker] = {}
        self._by_model: dict[str, list[Worker]] = {}
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
        self.on_pending: Callable[[], None] | None = None
        """Called when a worker starts waiting for its facts (the facts service listens)."""
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
        return sorted(self._by_model)

    def for_model(self, model: str) -> list[Worker]:
        """Workers of every role and status registered for `model` (empty when none)."""
        return self._by_model.get(model, [])

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
        at the same URL; when there are none yet, the worker waits in `pending` (out of
        routing) and None is returned.
        """
        if record.unknown_facts:
            learned = self._learned.get(record.id)
            if learned is None or learned.url != record.url:
                self._hold(record)
                return None
            record = fill_facts(record, learned)
        self.pending.pop(record.id, None)
        worker = self._workers.get(record.id)
        old_url: str | None = None
        if worker is None:
            worker = Worker(record=record, breaker=self._breaker_factory(record.id), max_inflight=self._max_inflight)
            self._workers[record.id] = worker
        else:
            if record.dp_size != worker.record.dp_size:
                # Requests in flight keep their rank's count until they end (see `end`).
                kept = worker.rank_inflight[: record.dp_size]
                worker.rank_inflight = kept + [0] * (record.dp_size - len(kept))
            if record.url != worker.record.url:
                old_url = worker.record.url
            worker.record = record
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

    def _hold(self, record: WorkerRecord) -> None:
        previous = self.pending.get(record.id)
        if previous is None or previous.record.url != record.url:
            self.pending[record.id] = PendingWorker(record)
        else:
            previous.record = record
        held_back = self._workers.pop(record.id, None)
        if held_back is not None:
            # Out of routing until its new facts are known: what it left elsewhere goes.
            self._reindex()
            self._departed([held_back])
        if self.on_pending is not None:
            self.on_pending()

    def remove(self, worker_id: str) -> Worker | None:
        self.pending.pop(worker_id, None)
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
        for table in (self.pending, self._learned):
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
        for worker in self._workers.values():
            for model in worker.record.models:
                by_model.setdefault(model, []).append(worker)
        self._remember_models(self._by_model, by_model)
        self._by_model = by_model
        self._urls = {worker.url for worker in self._workers.values()}
        self.generation += 1

    def _remember_models(self, before: dict[str, list[Worker]], after: dict[str, list[Worker]]) -> None:
        if self._clock is None or self._model_memory_s <= 0:
            return
        now = self._clock()
        for model in before.keys() - after.keys():
            self._models_gone_at[model] = now
        if self._models_gone_at:
            oldest_kept = now - self._model_memory_s
            self._models_gone_at = {
                model: gone_at for model, gone_at in self._models_gone_at.items()
                if model not in after and gone_at > oldest_kept
            }

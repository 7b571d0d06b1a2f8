"""Worker records, the fleet registry and the router's own load accounting.

A `WorkerRecord` is what discovery knows about a worker (static flags, a fleet file or an
etcd key). A `Worker` is the router's live view of it: the record plus health, in-flight
counts and breaker. Only discovery replaces a record; only the health checker writes
`healthy`; nothing in the router ever writes `status` (the worker's own registration does).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from router.http.worker_url import InvalidWorkerUrl, parse_worker_url

if TYPE_CHECKING:
    from router.breaker import CircuitBreaker

_E = TypeVar("_E", bound=enum.StrEnum)


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
        raw_rank = data.get("dp_rank")
        dp_rank = None if raw_rank is None else _int_field(raw_rank, "dp_rank", minimum=0)
        if dp_rank is not None and dp_rank >= dp_size:
            raise InvalidWorkerRecord(f"'dp_rank' {dp_rank} must be below 'dp_size' {dp_size}")
        meta = data.get("disagg_meta")
        if meta is not None and not isinstance(meta, dict):
            raise InvalidWorkerRecord(f"'disagg_meta' must be an object, got {meta!r}")
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
        )

    def to_json(self) -> dict[str, Any]:
        """The record as registered; `status` is omitted while ACTIVE."""
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


class Fleet:
    """Every known worker by id, with an index by model kept current on each change.

    Changes (discovery events) are rare and requests are many, so the per-model lists are
    rebuilt on change and read without any scan per request.
    """

    def __init__(self, breaker_factory: BreakerFactory | None = None) -> None:
        self._breaker_factory = breaker_factory or (lambda _worker_id: None)
        self._workers: dict[str, Worker] = {}
        self._by_model: dict[str, list[Worker]] = {}
        self.generation = 0
        """Bumped on every change, so caches keyed on the fleet know when to refresh."""

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def for_model(self, model: str) -> list[Worker]:
        """Workers of every role and status registered for `model` (empty when none)."""
        return self._by_model.get(model, [])

    def upsert(self, record: WorkerRecord) -> Worker:
        """Add a worker or replace its record, keeping live state (load, breaker, health)."""
        worker = self._workers.get(record.id)
        if worker is None:
            worker = Worker(record=record, breaker=self._breaker_factory(record.id))
            self._workers[record.id] = worker
        else:
            if record.dp_size != worker.record.dp_size:
                # Requests in flight keep their rank's count until they end (see `end`).
                kept = worker.rank_inflight[: record.dp_size]
                worker.rank_inflight = kept + [0] * (record.dp_size - len(kept))
            worker.record = record
        self._reindex()
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._reindex()
        return worker

    def replace_all(self, records: Iterable[WorkerRecord]) -> None:
        """Make the fleet exactly `records` (a relist), keeping live state of survivors."""
        records = list(records)
        keep = {record.id for record in records}
        for worker_id in [wid for wid in self._workers if wid not in keep]:
            del self._workers[worker_id]
        for record in records:
            self.upsert(record)
        self._reindex()

    def _reindex(self) -> None:
        by_model: dict[str, list[Worker]] = {}
        for worker in self._workers.values():
            for model in worker.record.models:
                by_model.setdefault(model, []).append(worker)
        self._by_model = by_model
        self.generation += 1

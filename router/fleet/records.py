"""Worker records: what discovery knows about a worker, checked once where it is read.

A `WorkerRecord` comes from static flags, a fleet file, an etcd key or a Pod. It is
validated here (URL, role, DP size, handoff address), so nothing downstream meets a record
the pool or the PD pairing cannot use. Facts a record leaves to the engine are listed in
`unknown_facts` and filled in by `router.engines.facts`: until the facts routing
needs are known (`BLOCKING_FACTS`) the worker is pending; the ones that only describe it
(`DESCRIPTIVE_FACTS`: the engine's kind and what that kind states of itself) are learned
while it routes. Unknown stays unknown: a record that names no engine has `engine` None.
Nothing in the router ever writes `status`: the worker's own registration does.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from router.http.upstream.worker_url import InvalidWorkerUrl, parse_worker_url

_E = TypeVar("_E", bound=enum.StrEnum)

MAX_DP_SIZE: Final = 4096
"""Largest `dp_size` a record may claim: the router keeps one counter per rank."""


class Role(enum.StrEnum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Status(enum.StrEnum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"


class Mode(enum.StrEnum):
    """How a model's request is served: by one mixed worker, or by a prefill and a decode."""

    MIXED = "mixed"
    PD = "pd"


class InvalidWorkerRecord(ValueError):
    """A worker record that cannot be used; the message says which field and why."""


def disagg_meta(host: str, bootstrap_port: int | str, protocol: str = "mooncake") -> dict[str, Any]:
    """A prefill's `disagg_meta` record field: its KV transfer backend and the bootstrap
    address decode workers reach it at (an IPv6 host in brackets)."""
    address = f"[{host}]:{bootstrap_port}" if ":" in host else f"{host}:{bootstrap_port}"
    return {"protocol": protocol, "params": {"bootstrap_addr": address}}


@dataclass(frozen=True, slots=True)
class EventEndpoint:
    """Where one DP rank of a worker publishes ZMQ events: its KV-cache events (vLLM's
    `/kv_event_sources`) or its load (SGLang's load stream), as data for whoever
    subscribes; a `*` host the engine binds on is already replaced by the worker's own
    host."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "dp_rank": self.dp_rank,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    id: str
    url: str
    models: tuple[str, ...] = ()
    role: Role = Role.MIXED
    engine: str | None = None
    """`sglang`, `vllm` or another name the record gives; None while unknown (never a guess)."""
    dp_size: int = 1
    dp_rank: int | None = None
    disagg_meta: dict[str, Any] | None = None
    status: Status = Status.ACTIVE
    unknown_facts: frozenset[str] = frozenset()
    """Facts the record leaves to the engine (`FACTS`): the worker joins the fleet once
    they are learned (router.engines.facts); until then it is pending."""
    max_model_len: dict[str, int] = field(default_factory=dict)
    """Per served model, the longest sequence the engine takes (vLLM's `/v1/models`); empty
    while unknown."""
    model_roots: dict[str, str] = field(default_factory=dict)
    """Per served model, the directory the engine loaded it from, on the engine's host
    (vLLM's `/v1/models` `root`; learned with `max_model_len`); empty while unknown."""
    kv_event_sources: tuple[EventEndpoint, ...] = ()
    """The engine's KV-event publishers, one per DP rank (vLLM's `/kv_event_sources`);
    empty when the engine publishes none or has not said."""
    api_key: str | None = field(default=None, repr=False)
    """The key the router sends this worker (`Authorization: Bearer`); never listed back."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters the record declares the engine holds, each applying to the record's
    first model; what the engine's own model list says is learned beside them
    (`router.engines.adapter_lists`)."""

    @property
    def is_grpc(self) -> bool:
        """It speaks vLLM's gRPC engine service (`grpc://`): the router tokenizes for it."""
        return self.url.startswith("grpc://")

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
            raise InvalidWorkerRecord(
                f"a worker record must be an object, got {type(data).__name__}"
            )
        url = data.get("url")
        if not isinstance(url, str):
            raise InvalidWorkerRecord(f"'url' must be an http:// or grpc:// URL, got {url!r}")
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
            raise InvalidWorkerRecord(
                f"'model' must be a string or a list of strings, got {raw_models!r}"
            )
        role = _enum_field(Role, data.get("role", "mixed"), "role")
        if role is not Role.MIXED and url.startswith("grpc://"):
            raise InvalidWorkerRecord(
                f"worker URL {url!r}: prefill and decode workers over gRPC are not supported "
                "yet (the router's PD handoff is HTTP's); give the worker an http:// URL or "
                "role mixed"
            )
        status = _enum_field(Status, str(data.get("status", "ACTIVE")).upper(), "status")
        engine = data.get("engine")
        if engine is not None and (not isinstance(engine, str) or not engine):
            raise InvalidWorkerRecord(f"'engine' must be a non-empty string, got {engine!r}")
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
        if role is Role.PREFILL and not (
            isinstance(params, dict) and isinstance(params.get("bootstrap_addr"), str)
        ):
            # The engine knows its bootstrap port; its DP size comes with the same answer
            # unless the record gives one.
            unknown = frozenset(
                {"bootstrap_port"} if "dp_size" in data else {"bootstrap_port", "dp_size"}
            )
        unknown |= descriptive_facts(engine)
        adapters = _adapters_field(data.get("adapters", ()), tuple(raw_models))
        api_key = data.get("api_key")
        if api_key is not None and (
            not isinstance(api_key, str) or not api_key.isprintable() or " " in api_key
        ):
            # The value is a secret: the message does not repeat it.
            raise InvalidWorkerRecord(
                "'api_key' must be a string without spaces or control characters"
            )
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
            adapters=adapters,
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
        if self.adapters:
            data["adapters"] = list(self.adapters)
        if self.status is not Status.ACTIVE:
            data["status"] = self.status.value
        return data


BLOCKING_FACTS: Final = frozenset({"bootstrap_port", "dp_size", "models"})
"""Facts a record may leave to the engine that routing needs: a prefill's bootstrap port
and the DP size (SGLang's server info), the served models (`/v1/models`). The worker is
pending until they are learned."""

DESCRIPTIVE_FACTS: Final = frozenset({"engine", "max_model_len", "kv_event_sources"})
"""Facts that describe a worker without deciding whether it can be routed to: the engine's
kind, and what a vLLM engine states of itself. Learned while the worker routes."""

FACTS: Final = tuple(sorted(BLOCKING_FACTS | DESCRIPTIVE_FACTS))

_LEARNED_FIELDS: Final = {
    "bootstrap_port": ("disagg_meta",),
    "dp_size": ("dp_size",),
    "models": ("models",),
    "engine": ("engine",),
    "max_model_len": ("max_model_len", "model_roots"),  # one answer, /v1/models
    "kv_event_sources": ("kv_event_sources",),
}


def descriptive_facts(engine: str | None) -> frozenset[str]:
    """What is left to learn of a worker whose record names `engine` (None: not named):
    the kind itself when unknown, and the facts only vLLM states (an SGLang engine's are
    the blocking ones; an engine of another kind is not asked)."""
    if engine is None:
        return DESCRIPTIVE_FACTS
    if engine == "vllm":
        return frozenset({"max_model_len", "kv_event_sources"})
    return frozenset()


def fill_facts(record: WorkerRecord, learned: WorkerRecord) -> WorkerRecord:
    """`record` with each fact it leaves open taken from `learned` (a record of the same
    worker), where `learned` settled it; every value `record` gives explicitly stays. What
    `learned` still leaves open stays in `unknown_facts`."""
    settled = record.unknown_facts - learned.unknown_facts
    changes: dict[str, Any] = {
        name: getattr(learned, name) for fact in settled for name in _LEARNED_FIELDS[fact]
    }
    return dataclasses.replace(record, unknown_facts=record.unknown_facts - settled, **changes)


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


def _adapters_field(value: Any, models: tuple[str, ...]) -> tuple[str, ...]:
    """A record's `adapters`: a list of names (or one string, `a+b` for several), none of
    them one of the record's models."""
    if isinstance(value, str):
        value = [name for name in value.split("+") if name]
    if not isinstance(value, list | tuple) or not all(isinstance(a, str) and a for a in value):
        raise InvalidWorkerRecord(
            f"'adapters' must be a string or a list of strings, got {value!r}"[:200]
        )
    clash = sorted(set(value) & set(models))
    if clash:
        raise InvalidWorkerRecord(
            f"'adapters' names {', '.join(clash)}, which the record also serves as a model"
        )
    return tuple(dict.fromkeys(value))


def _int_field(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidWorkerRecord(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value

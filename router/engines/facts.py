"""Fleet facts from the engine: what a worker record leaves open, the engine states.

A prefill named without a bootstrap port (a `--worker` flag, an etcd record or a Pod
without the annotation) learns it from SGLang's server info (`GET /get_server_info`, or
`/server_info` where that is 404: `disaggregation_bootstrap_port`, with
`disaggregation_transfer_backend` and `dp_size`); a record without models learns them from
`GET /v1/models`. Until those facts are learned a worker waits in `Fleet.pending`, out of
routing, and `/v1/workers` lists it with the reason; the engine is asked again with
backoff.

The engine's kind is learned the same way when the record names none, but the worker
routes meanwhile (the kind is not needed to route), and unknown stays unknown (`None`)
when the engine's answers fit neither kind. The rule (`engine_kind`), from the answers
only, never from the port or the name:

- `sglang`: the server info (`/get_server_info`, else `/server_info`) answers 200 with a
  JSON object holding SGLang's server arguments: a string `model_path`, an integer
  `tp_size` and a string `version`.
- `vllm`: both server-info paths answer 404 (vLLM serves neither) and `GET /version`
  answers 200 with exactly vLLM's object, `{"version": "<string>"}`; or `/server_info`
  answers vLLM's development-mode object (it holds `vllm_config`).
- otherwise unknown. A 5xx, 429, transport error or timeout on the way decides nothing:
  the engine is asked again with backoff.

What a kind states of itself is learned with it: for vLLM, `max_model_len` and the
model's directory on the engine's host (`root`) per model from `/v1/models`, and its KV-event publishers from `/kv_event_sources` (kept on the record as
data; a `*` host, where the engine binds, becomes the worker's own host). An SGLang
engine's load publishers (`load_event_endpoints`) are asked by the load reader, which
alone needs them. An explicit value
always wins: only the facts in `WorkerRecord.unknown_facts` are asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import orjson
import trio

from router.engines.grpc_service import GrpcFactsUnavailable, GrpcMessagesMissing, learn_grpc_facts
from router.engines.models import fetch_models
from router.fleet.records import (
    BLOCKING_FACTS,
    DESCRIPTIVE_FACTS,
    EventEndpoint,
    Role,
    WorkerRecord,
    disagg_meta,
)
from router.fleet.registry import Fleet
from router.http.backoff import Backoff
from router.http.capped_reads import StreamTooLarge, read_capped
from router.http.grpc import GrpcPool

log = logging.getLogger("router.engine_facts")

MAX_SERVER_INFO_BYTES = 1024 * 1024
"""SGLang's answer is a few KiB; a worker that sends more is not read further."""

SERVER_INFO_PATHS = ("/get_server_info", "/server_info")
"""Every SGLang release serves the first; newer ones also the second (and deprecate the
first). The second is asked only when the first is 404."""


class FactsUnavailable(Exception):
    """The engine did not state a fact the record needs; the message says which and why."""


@dataclass(frozen=True, slots=True)
class FactsSettings:
    timeout_s: float = 5.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    worker_api_key: str = field(default="", repr=False)
    """The key the engines are asked with when a record carries none of its own
    (`--worker-api-key`): engines that guard their routes guard these too."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One engine answer: its status, and its JSON (`NOT_JSON` when the body is not)."""

    path: str
    status: int
    body: Any


NOT_JSON: Final = object()


def complete_record(record: WorkerRecord, server_info: Any) -> WorkerRecord:
    """`record` with its bootstrap port and DP size taken from a `/get_server_info` answer.

    Raises FactsUnavailable when the answer lacks a fact the record needs, or states one
    that cannot be right (a port outside 1-65535, a DP size below 1, a prefill whose
    engine does not run in prefill mode).
    """
    if not isinstance(server_info, dict):
        raise FactsUnavailable(f"{record.url}/get_server_info is not a JSON object")
    changes: dict[str, Any] = {}
    if "dp_size" in record.unknown_facts:
        dp_size = server_info.get("dp_size", 1)
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise FactsUnavailable(f"{record.url}/get_server_info states dp_size {dp_size!r}")
        changes["dp_size"] = dp_size
    if "bootstrap_port" in record.unknown_facts:
        mode = server_info.get("disaggregation_mode")
        if record.role is Role.PREFILL and mode != "prefill":
            raise FactsUnavailable(
                f"{record.url} is named a prefill worker, but its engine runs with "
                f"disaggregation_mode {mode!r}"
            )
        port = server_info.get("disaggregation_bootstrap_port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise FactsUnavailable(
                f"{record.url}/get_server_info states no usable disaggregation_bootstrap_port ({port!r})"
            )
        protocol = server_info.get("disaggregation_transfer_backend")
        host = urlsplit(record.url).hostname or "127.0.0.1"
        changes["disagg_meta"] = disagg_meta(
            host, port, protocol if isinstance(protocol, str) and protocol else "mooncake"
        )
    return replace(record, **changes)


async def ask(
    http: httpx.AsyncClient, url: str, path: str, timeout_s: float, api_key: str | None = None
) -> Answer:
    """`GET url+path`, its body read up to MAX_SERVER_INFO_BYTES and parsed as JSON.

    Raises FactsUnavailable for a transport error, a timeout or an oversize body; any
    status is an answer.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    try:
        with trio.fail_after(timeout_s):
            async with http.stream(
                "GET", url + path, timeout=timeout_s, headers=headers
            ) as response:
                body = await read_capped(response, MAX_SERVER_INFO_BYTES)
    except trio.TooSlowError:
        raise FactsUnavailable(f"{url}{path} did not answer within {timeout_s:g}s") from None
    except StreamTooLarge:
        raise FactsUnavailable(
            f"{url}{path} is larger than {MAX_SERVER_INFO_BYTES} bytes"
        ) from None
    except httpx.HTTPError as exc:
        raise FactsUnavailable(f"{url}{path} failed: {exc!r}") from None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = NOT_JSON
    return Answer(path, response.status_code, parsed)


async def ask_server_info(
    http: httpx.AsyncClient, url: str, timeout_s: float, api_key: str | None = None
) -> Answer:
    """The engine's server info: `/get_server_info`, or `/server_info` when that is 404.
    Raises FactsUnavailable as `ask` does."""
    answer = await ask(http, url, SERVER_INFO_PATHS[0], timeout_s, api_key)
    if answer.status == 404:
        answer = await ask(http, url, SERVER_INFO_PATHS[1], timeout_s, api_key)
    return answer


def _settles(url: str, answer: Answer) -> None:
    """Raise FactsUnavailable for an answer that says the engine is not ready (5xx, 429):
    it decides nothing yet."""
    if answer.status >= 500 or answer.status == 429:
        raise FactsUnavailable(f"{url}{answer.path} answered {answer.status}")


def is_sglang_server_info(body: Any) -> bool:
    """SGLang's server info: its server arguments (`model_path`, `tp_size`) and `version`."""
    return (
        isinstance(body, dict)
        and isinstance(body.get("model_path"), str)
        and isinstance(body.get("tp_size"), int)
        and isinstance(body.get("version"), str)
    )


def is_vllm_version(body: Any) -> bool:
    """vLLM's `/version`: an object with one key, `version`, a string."""
    return (
        isinstance(body, dict) and body.keys() == {"version"} and isinstance(body["version"], str)
    )


def engine_kind(server_info: Answer, version: Answer | None) -> str | None:
    """The engine's kind from its answers (the rule in this module's docstring); None when
    they fit neither kind. `version` may be None when `server_info` decides alone.

    Raises FactsUnavailable for an answer that decides nothing yet (5xx, 429).
    """
    _settles("", server_info)
    if server_info.status == 200:
        if is_sglang_server_info(server_info.body):
            return "sglang"
        if isinstance(server_info.body, dict) and "vllm_config" in server_info.body:
            return "vllm"  # vLLM's development-mode /server_info
        return None  # a server info of some other engine
    if server_info.status != 404 or version is None:
        return None
    _settles("", version)
    if version.status == 200 and is_vllm_version(version.body):
        return "vllm"
    return None


async def detect_engine(
    http: httpx.AsyncClient,
    url: str,
    timeout_s: float,
    *,
    api_key: str | None = None,
    server_info: Answer | None = None,
) -> str | None:
    """The kind of the engine at `url` (`engine_kind`), asking what it has not answered
    yet (`server_info` when already asked). Raises FactsUnavailable when the engine cannot
    be asked or is not ready to say."""
    if server_info is None:
        server_info = await ask_server_info(http, url, timeout_s, api_key)
    version = None
    if server_info.status == 404:
        version = await ask(http, url, "/version", timeout_s, api_key)
    try:
        return engine_kind(server_info, version)
    except FactsUnavailable as exc:
        raise FactsUnavailable(f"{url}{exc}") from None


def max_model_lens(body: Any) -> dict[str, int]:
    """`max_model_len` per model id from a `/v1/models` answer (models without one left out)."""
    data = body.get("data") if isinstance(body, dict) else None
    lengths: dict[str, int] = {}
    for entry in data if isinstance(data, list) else ():
        if not isinstance(entry, dict):
            continue
        model, length = entry.get("id"), entry.get("max_model_len")
        if isinstance(model, str) and isinstance(length, int) and not isinstance(length, bool):
            if length > 0:
                lengths[model] = length
    return lengths


def model_roots(body: Any) -> dict[str, str]:
    """The directory each model was loaded from, on the engine's host, from a vLLM
    `/v1/models` answer (`root`; models without one, or whose root is their own id, as
    for a model named by its hub id, left out)."""
    data = body.get("data") if isinstance(body, dict) else None
    roots: dict[str, str] = {}
    for entry in data if isinstance(data, list) else ():
        if not isinstance(entry, dict):
            continue
        model, root = entry.get("id"), entry.get("root")
        if isinstance(model, str) and isinstance(root, str) and root and root.startswith("/"):
            roots[model] = root
    return roots


def kv_event_endpoints(body: Any, worker_url: str) -> tuple[EventEndpoint, ...]:
    """The KV-event publishers in a `/kv_event_sources` answer, one per DP rank.

    vLLM 0.32 answers an object keyed by DP rank whose values are its events config
    (`endpoint`, `replay_endpoint`, `topic`, `publisher`); other releases answer a list,
    or `{"sources": [...]}`, of objects carrying `data_parallel_rank`. An entry without a
    string `endpoint`, or with a publisher other than ZMQ, is left out. A `*` host (the
    engine binds on every interface) becomes `worker_url`'s host.
    """
    if isinstance(body, dict) and isinstance(body.get("sources"), list):
        body = body["sources"]
    entries: list[tuple[Any, Any]] = []
    if isinstance(body, list):
        entries = [
            (entry.get("data_parallel_rank", 0) if isinstance(entry, dict) else None, entry)
            for entry in body
        ]
    elif isinstance(body, dict):
        entries = list(body.items())
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    found: dict[int, EventEndpoint] = {}
    for raw_rank, entry in entries:
        try:
            rank = int(raw_rank)
        except (TypeError, ValueError):
            continue
        if not isinstance(entry, dict) or rank < 0:
            continue
        endpoint, replay = entry.get("endpoint"), entry.get("replay_endpoint")
        if not isinstance(endpoint, str) or entry.get("publisher", "zmq") != "zmq":
            continue
        topic = entry.get("topic")
        found[rank] = EventEndpoint(
            dp_rank=rank,
            endpoint=_own_host(endpoint, host),
            replay_endpoint=_own_host(replay, host) if isinstance(replay, str) else None,
            topic=topic if isinstance(topic, str) else "",
        )
    return tuple(found[rank] for rank in sorted(found))


def load_event_endpoints(server_info: Any, worker_url: str) -> tuple[EventEndpoint, ...]:
    """SGLang's load publishers from its `/server_info`: the `kv_events` block names
    `load_endpoint_port_base` (rank r publishes at base + r on the worker's own host: the
    block's `endpoint_host` is where the engine binds, a wildcard) with `load_topic` and
    `dp_size`. None advertised (no block, no load port: the stream is opt-in), or a
    block that does not hold together, gives none."""
    block = server_info.get("kv_events") if isinstance(server_info, dict) else None
    if not isinstance(block, dict):
        return ()
    base, topic = block.get("load_endpoint_port_base"), block.get("load_topic", "load")
    dp_size = block.get("dp_size", server_info.get("dp_size", 1))
    if isinstance(base, bool) or not isinstance(base, int) or not isinstance(topic, str):
        return ()
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        return ()
    if not 0 < base or base + dp_size - 1 > 65535:
        return ()
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return tuple(
        EventEndpoint(dp_rank=rank, endpoint=f"tcp://{host}:{base + rank}", topic=topic)
        for rank in range(dp_size)
    )


def _own_host(endpoint: str, host: str) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if sep and rest.startswith("*:"):
        return f"{scheme}://{host}{rest[1:]}"
    return endpoint


async def describe_engine(
    http: httpx.AsyncClient,
    record: WorkerRecord,
    timeout_s: float,
    server_info: Answer | None = None,
    api_key: str | None = None,
) -> WorkerRecord:
    """`record` with its descriptive facts learned: the engine's kind when the record names
    none, then what that kind states of itself (vLLM: `max_model_len`, KV-event sources),
    asked with `api_key` (default: the record's). Raises FactsUnavailable when the engine
    cannot be asked or is not ready to say."""
    api_key = api_key or record.api_key
    unknown = record.unknown_facts
    if not unknown & DESCRIPTIVE_FACTS:
        return record
    changes: dict[str, Any] = {}
    engine = record.engine
    if "engine" in unknown:
        engine = await detect_engine(
            http, record.url, timeout_s, api_key=api_key, server_info=server_info
        )
        changes["engine"] = engine
        if engine is not None:
            log.info("worker %s runs %s (as its engine answers)", record.id, engine)
    if engine == "vllm":
        if "max_model_len" in unknown:
            models = await ask(http, record.url, "/v1/models", timeout_s, api_key)
            _settles(record.url, models)
            changes["max_model_len"] = max_model_lens(models.body)
            changes["model_roots"] = model_roots(models.body)
        if "kv_event_sources" in unknown:
            # 404 from releases without the route; `{}` while events are off.
            sources = await ask(http, record.url, "/kv_event_sources", timeout_s, api_key)
            _settles(record.url, sources)
            if sources.status == 200:
                changes["kv_event_sources"] = kv_event_endpoints(sources.body, record.url)
    return replace(record, unknown_facts=unknown - DESCRIPTIVE_FACTS, **changes)


def _server_info_body(url: str, answer: Answer) -> Any:
    if answer.status != 200:
        raise FactsUnavailable(f"{url}{answer.path} answered {answer.status}")
    if answer.body is NOT_JSON:
        raise FactsUnavailable(f"{url}{answer.path} is not JSON")
    return answer.body


async def learn_facts(
    http: httpx.AsyncClient, record: WorkerRecord, timeout_s: float, worker_api_key: str = ""
) -> WorkerRecord:
    """A record of `record`'s worker with its `unknown_facts` answered by the engine, asked
    with the record's key, else `worker_api_key` (when either is set).

    Raises FactsUnavailable when a fact routing needs (`BLOCKING_FACTS`) cannot be
    learned, or, when the record needs none, when the descriptive ones cannot; when it
    needs both, descriptive facts not learned yet stay in `unknown_facts` of the answer,
    so the worker routes while they are asked again.
    """
    learned = record
    api_key = record.api_key or worker_api_key or None
    server_info: Answer | None = None
    if {"bootstrap_port", "dp_size"} & record.unknown_facts:
        server_info = await ask_server_info(http, record.url, timeout_s, api_key)
        if (
            server_info.status == 404
            and "bootstrap_port" not in record.unknown_facts
            and record.engine != "sglang"
        ):
            # Not SGLang's server: an engine that states no DP size serves all ranks
            # behind its one URL, so the router picks none.
            learned = replace(learned, dp_size=1)
        else:
            learned = complete_record(learned, _server_info_body(record.url, server_info))
    if "models" in record.unknown_facts:
        try:
            learned = replace(
                learned, models=await fetch_models(http, record.url, timeout_s, api_key=api_key)
            )
        except (httpx.HTTPError, ValueError) as exc:
            raise FactsUnavailable(f"{record.url}/v1/models: {exc}") from None
    blocking = record.unknown_facts & BLOCKING_FACTS
    learned = replace(learned, unknown_facts=record.unknown_facts - BLOCKING_FACTS)
    try:
        return await describe_engine(http, learned, timeout_s, server_info, api_key)
    except FactsUnavailable as exc:
        if not blocking:
            raise
        log.info("worker %s: %s; its engine kind is asked again while it routes", record.id, exc)
        return learned


@dataclass(slots=True)
class _Retries:
    backoff: Backoff
    next_at: float = 0.0
    last_reason: str = ""


@dataclass(slots=True)
class _Learner:
    fleet: Fleet
    http: httpx.AsyncClient
    settings: FactsSettings
    grpc: GrpcPool | None = None
    wake: trio.Event = field(default_factory=trio.Event)
    in_flight: set[str] = field(default_factory=set)
    retries: dict[str, _Retries] = field(default_factory=dict)

    def poke(self) -> None:
        self.wake.set()

    async def attempt(self, record: WorkerRecord) -> None:
        try:
            if record.is_grpc:
                learned = await self._learn_grpc(record)
            else:
                learned = await learn_facts(
                    self.http, record, self.settings.timeout_s, self.settings.worker_api_key
                )
        except FactsUnavailable as exc:
            self._failed(record, str(exc))
        else:
            pending = self.fleet.pending.get(record.id)
            if pending is not None and pending.record == record:
                worker = self.fleet.admit(record, learned)
                if worker is not None:
                    log.info(
                        "worker %s admitted with facts from its engine: dp_size %d, "
                        "bootstrap %s, models %s",
                        record.id,
                        learned.dp_size,
                        learned.bootstrap_addr,
                        "+".join(learned.models),
                    )
            else:
                self.fleet.describe(record, learned)
            if learned.unknown_facts:
                # Admitted, but the engine's kind is still to be learned: ask again later.
                self._failed(record, "its engine did not say what it runs yet")
            else:
                self.retries.pop(record.id, None)
        finally:
            self.in_flight.discard(record.id)
            self.poke()

    async def _learn_grpc(self, record: WorkerRecord) -> WorkerRecord:
        """A gRPC worker's facts, all from its engine service (router.engines.grpc_service)."""
        if self.grpc is None:
            raise FactsUnavailable(f"{record.url}: this router has no gRPC pool")
        try:
            return await learn_grpc_facts(self.grpc, record, self.settings.timeout_s)
        except (GrpcFactsUnavailable, GrpcMessagesMissing) as exc:
            raise FactsUnavailable(str(exc)) from None

    def _failed(self, record: WorkerRecord, reason: str) -> None:
        retries = self.retries.setdefault(
            record.id,
            _Retries(Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)),
        )
        delay = retries.backoff.failure()
        retries.next_at = trio.current_time() + delay
        pending = self.fleet.pending.get(record.id)
        if retries.last_reason != reason:
            retries.last_reason = reason
            if pending is not None:
                log.warning(
                    "worker %s is not admitted: %s; asking again with backoff", record.id, reason
                )
            else:
                log.info(
                    "worker %s routes, its engine's kind not known yet: %s; asking again",
                    record.id,
                    reason,
                )
        if pending is not None and pending.record == record:
            pending.reason = f"{reason}; next try in {delay:g}s"

    def due(self, now: float) -> tuple[list[WorkerRecord], float]:
        """Records to ask now (pending, then routing ones still to describe), and when the
        next one falls due."""
        fleet = self.fleet
        waiting = [(wid, pending.record) for wid, pending in fleet.pending.items()]
        waiting += list(fleet.describing.items())
        for worker_id in [
            wid for wid in self.retries if wid not in fleet.pending and wid not in fleet.describing
        ]:
            del self.retries[worker_id]
        ready, soonest = [], float("inf")
        for worker_id, record in waiting:
            if worker_id in self.in_flight:
                continue
            retries = self.retries.get(worker_id)
            at = retries.next_at if retries is not None else now
            if at <= now:
                ready.append(record)
            else:
                soonest = min(soonest, at)
        return ready, soonest


async def serve_engine_facts(
    fleet: Fleet,
    http: httpx.AsyncClient,
    settings: FactsSettings = FactsSettings(),
    *,
    grpc: GrpcPool | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Learn the facts of every pending worker as soon as discovery names it, and the
    descriptive facts of every routing one (`Fleet.describing`), until cancelled; a
    `grpc://` worker's over its engine service (`grpc`). At most
    one question per worker is in flight; a worker whose engine does not answer is asked
    again with backoff (`settings`), its reason kept in `pending`.

    Cancellation: questions in flight are abandoned; pending workers stay pending, workers
    still to describe keep routing with their kind unknown.
    """
    learner = _Learner(fleet, http, settings, grpc)
    fleet.on_pending = learner.poke
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                learner.wake = trio.Event()
                ready, soonest = learner.due(trio.current_time())
                for record in ready:
                    learner.in_flight.add(record.id)
                    nursery.start_soon(learner.attempt, record)
                with trio.move_on_at(soonest):
                    await learner.wake.wait()
    finally:
        fleet.on_pending = None

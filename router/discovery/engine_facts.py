"""Fleet facts from the engine: what a worker record leaves open, the engine states.

A prefill named without a bootstrap port (a `--worker` flag, an etcd record or a Pod
without the annotation) learns it from SGLang's `GET /get_server_info`
(`disaggregation_bootstrap_port`, with `disaggregation_transfer_backend` and `dp_size`);
a record without models learns them from `GET /v1/models`. An explicit value always
wins: only the facts in `WorkerRecord.unknown_facts` are asked for.

Until its facts are learned a worker waits in `Fleet.pending`, out of routing, and
`/v1/workers` lists it with the reason; the engine is asked again with backoff.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import trio

from router.discovery.backoff import Backoff
from router.discovery.static import fetch_models
from router.discovery.streams import close_stream
from router.fleet.records import Role, WorkerRecord, disagg_meta
from router.fleet.registry import Fleet

log = logging.getLogger("router.engine_facts")

MAX_SERVER_INFO_BYTES = 1024 * 1024
"""SGLang's answer is a few KiB; a worker that sends more is not read further."""


class FactsUnavailable(Exception):
    """The engine did not state a fact the record needs; the message says which and why."""


@dataclass(frozen=True, slots=True)
class FactsSettings:
    timeout_s: float = 5.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0


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


async def fetch_server_info(http: httpx.AsyncClient, url: str, timeout_s: float) -> Any:
    """The JSON of `GET url/get_server_info`, read up to MAX_SERVER_INFO_BYTES.

    Raises FactsUnavailable for a transport error, a non-200 answer, an oversize or
    non-JSON body.
    """
    try:
        with trio.fail_after(timeout_s):
            async with http.stream("GET", url + "/get_server_info", timeout=timeout_s) as response:
                if response.status_code != 200:
                    raise FactsUnavailable(f"{url}/get_server_info answered {response.status_code}")
                body = bytearray()
                chunks = response.aiter_bytes()
                try:
                    async for chunk in chunks:
                        body += chunk
                        if len(body) > MAX_SERVER_INFO_BYTES:
                            raise FactsUnavailable(
                                f"{url}/get_server_info is larger than {MAX_SERVER_INFO_BYTES} bytes"
                            )
                finally:
                    await close_stream(response, chunks)
    except trio.TooSlowError:
        raise FactsUnavailable(
            f"{url}/get_server_info did not answer within {timeout_s:g}s"
        ) from None
    except httpx.HTTPError as exc:
        raise FactsUnavailable(f"{url}/get_server_info failed: {exc!r}") from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise FactsUnavailable(f"{url}/get_server_info is not JSON") from None


async def learn_facts(
    http: httpx.AsyncClient, record: WorkerRecord, timeout_s: float
) -> WorkerRecord:
    """A complete record of `record`'s worker (its `unknown_facts` answered by the engine).
    Raises FactsUnavailable."""
    learned = record
    if {"bootstrap_port", "dp_size"} & record.unknown_facts:
        learned = complete_record(learned, await fetch_server_info(http, record.url, timeout_s))
    if "models" in record.unknown_facts:
        try:
            learned = replace(learned, models=await fetch_models(http, record.url, timeout_s))
        except (httpx.HTTPError, ValueError) as exc:
            raise FactsUnavailable(f"{record.url}/v1/models: {exc}") from None
    return replace(learned, unknown_facts=frozenset())


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
    wake: trio.Event = field(default_factory=trio.Event)
    in_flight: set[str] = field(default_factory=set)
    retries: dict[str, _Retries] = field(default_factory=dict)

    def poke(self) -> None:
        self.wake.set()

    async def attempt(self, record: WorkerRecord) -> None:
        try:
            learned = await learn_facts(self.http, record, self.settings.timeout_s)
        except FactsUnavailable as exc:
            retries = self.retries.setdefault(
                record.id,
                _Retries(Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)),
            )
            delay = retries.backoff.failure()
            retries.next_at = trio.current_time() + delay
            if retries.last_reason != str(exc):
                retries.last_reason = str(exc)
                log.warning(
                    "worker %s is not admitted: %s; asking again with backoff", record.id, exc
                )
            pending = self.fleet.pending.get(record.id)
            if pending is not None and pending.record == record:
                pending.reason = f"{exc}; next try in {delay:g}s"
        else:
            self.retries.pop(record.id, None)
            if self.fleet.admit(record, learned) is not None:
                log.info(
                    "worker %s admitted with facts from its engine: dp_size %d, bootstrap %s, models %s",
                    record.id,
                    learned.dp_size,
                    learned.bootstrap_addr,
                    "+".join(learned.models),
                )
        finally:
            self.in_flight.discard(record.id)
            self.poke()

    def due(self, now: float) -> tuple[list[WorkerRecord], float]:
        """Pending records to ask now, and when the next one falls due."""
        for worker_id in [wid for wid in self.retries if wid not in self.fleet.pending]:
            del self.retries[worker_id]
        ready, soonest = [], float("inf")
        for worker_id, pending in self.fleet.pending.items():
            if worker_id in self.in_flight:
                continue
            retries = self.retries.get(worker_id)
            at = retries.next_at if retries is not None else now
            if at <= now:
                ready.append(pending.record)
            else:
                soonest = min(soonest, at)
        return ready, soonest


async def serve_engine_facts(
    fleet: Fleet,
    http: httpx.AsyncClient,
    settings: FactsSettings = FactsSettings(),
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Learn the facts of every pending worker as soon as discovery names it, until
    cancelled. At most one question per worker is in flight; a worker whose engine does
    not answer is asked again with backoff (`settings`), its reason kept in `pending`.

    Cancellation: questions in flight are abandoned; pending workers stay pending.
    """
    learner = _Learner(fleet, http, settings)
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

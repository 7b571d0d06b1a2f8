"""The fleet's reader of engine load: one task per worker while it is in the fleet.

Which way a worker's engine is read (`LoadSource`), decided from what it is and serves:

- `stream`: the engine pushes its load (SGLang's `--load-publish-endpoint`, advertised
  in the `kv_events` block of its `/server_info`, which the reader asks first of an
  SGLang engine): one ZMQ subscription per DP rank; a rank silent for `silence_s` (three
  of the engine's one-second heartbeats) is unknown until it speaks again;
- `loads`: an SGLang engine without the stream: `GET /v1/loads` every `interval_s` (a
  release without the route answers 404, and the task moves to `metrics`);
- `metrics`: vLLM, and an engine of unknown kind: `GET /metrics` every `interval_s`,
  reading only the running, waiting and KV-usage families (`router.engines.load_readings`),
  and from the same page the engine's LoRA adapter slots (`router.engines.lora_activity`).
- `server_load`: a vLLM engine of one DP rank, beside `metrics`: `GET /load` every
  `server_load_interval_s`, the requests its API server holds (counted as they arrive,
  not once its scheduler takes them in, and a tiny answer where `/metrics` renders the
  whole page). vLLM answers 0 there when started without `--enable-server-load-tracking`,
  which cannot be told from an idle engine, so its readings count only once one has
  shown a request (`proven`); until then, and again whenever a read fails, or three
  readings in a row hold fewer than this process's own requests the engine must have
  taken in, or three metrics readings in a row hold more than `/load` said (an engine
  restarted without the flag), the load comes from `/metrics`. The metrics poll goes on
  meanwhile for the KV usage and the adapter slots.
- `grpc_loads`: a `grpc://` worker: its engine service's `GetLoads` every `interval_s`
  (each DP rank's running and waiting requests, its KV usage), over the router's gRPC
  pool (router.engines.grpc_service).

A read that fails, answers other than 200, is too large or cannot be read makes every
view of the worker unknown at once; so does a read that times out (`timeout_s`), but the
first of a row of them leaves the last reading standing (one slow read of a busy engine
is bridged, a second in a row is not), so no reading is ever older than the interval plus
twice the timeout; each outcome is counted. What a reading means for
the load policies read is `router.fleet.load`: the reading lands in the worker's engine
shares, with the time it was taken (when the read was sent: the engine's figure is at
least that recent).

The tasks follow the fleet like the KV-event subscriptions do: reconciled whenever the
fleet changes; a worker that leaves, or whose URL, engine or sources change, has its task
cancelled (and a new one started for what it is now). Polls go through the router's own
upstream pool (llhttp, one kept-alive connection per engine between reads): measured, an
httpx read cost the router 1.4 ms of CPU, four times the parse (docs/performance.md,
"Engine load"). The server-info ask that finds a pushed stream, once per worker, uses
httpx.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import httpx
import orjson
import trio
import zmq

from router.engines.facts import FactsUnavailable, ask_server_info, load_event_endpoints
from router.engines.grpc_service import GrpcFactsUnavailable, GrpcMessagesMissing, scheduler_loads
from router.engines.load_readings import (
    LOAD_TOPIC,
    BadReading,
    RankReading,
    load_message,
    loads_readings,
    metrics_readings,
    server_load_count,
    whole_engine,
)
from router.engines.lora_activity import adapter_activity
from router.engines.zmq_trio import close_socket, recv_multipart, socket_fd
from router.fleet.records import EventEndpoint
from router.fleet.registry import Fleet, Worker
from router.http.grpc import GrpcPool
from router.http.upstream.exceptions import LocalShortage, UpstreamError
from router.http.upstream.pool import UpstreamPool, open_upstream_pool

log = logging.getLogger("router.engine_load")


class LoadSource(enum.StrEnum):
    STREAM = "stream"
    LOADS = "loads"
    METRICS = "metrics"
    GRPC_LOADS = "grpc_loads"
    """A `grpc://` worker's `GetLoads` (router.engines.grpc_service)."""
    SERVER_LOAD = "server_load"
    """A vLLM engine's `/load`, once proven (beside `metrics`)."""


OUTCOMES = ("ok", "partial", "failed", "timeout", "bad_answer", "silent", "unproven")
"""How a read ended: every view known (`ok`); some ranks read, others not (`partial`); no
answer (`failed`: transport error or a status other than 200; `timeout`); an answer with
no usable load in it (`bad_answer`: garbage, too large, no gauge, no usable count); a
pushed stream that went quiet (`silent`); a `/load` answer that cannot be told from an
engine that does not count (`unproven`: 0 before any reading showed a request)."""

UNDERCOUNTS_TO_DISTRUST = 3
"""Readings of `/load` in a row below this process's own requests the engine must hold
that stop its use: one can be a race with an answer's end (the engine forgets a request a
moment before this process sees its last byte); three are an engine that stopped
counting."""


@dataclass(frozen=True, slots=True)
class LoadReaderSettings:
    interval_s: float = 0.5
    """Seconds between polls of an engine (docs/policies.md, "Replicas", says why 0.5)."""
    timeout_s: float = 1.0
    """A poll not answered within this is late: a second late one in a row makes the load
    unknown (the first leaves the last reading standing)."""
    window_s: float = 0.25
    """This process's requests sent within this before a reading are presumed not
    counted in it (`router.fleet.load`)."""
    silence_s: float = 3.0
    """A pushed stream rank silent this long is unknown (three heartbeats)."""
    reconcile_s: float = 0.2
    max_answer_bytes: int = 4 * 1024 * 1024
    """A metrics page or loads answer past this is not read (vLLM's page is ~50 kB)."""
    worker_api_key: str = field(default="", repr=False)
    """Sent to engines whose records carry no key of their own (`--worker-api-key`)."""
    server_load_interval_s: float = 0.1
    """Seconds between reads of a vLLM engine's `/load`; 0: not read (docs/policies.md,
    "Replicas", says why 0.1)."""
    server_load_window_s: float = 0.05
    """As `window_s`, for `/load`: the engine counts a request as its handler takes it,
    before tokenizing, so only requests still on the wire can be missing from it."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "silence_s", "reconcile_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"engine load {name} must be above 0, not {getattr(self, name)!r}")
        for name in ("window_s", "server_load_interval_s", "server_load_window_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(
                    f"engine load {name} must be 0 or more, not {getattr(self, name)!r}"
                )


def polled_source(worker: Worker) -> LoadSource:
    """How `worker`'s engine load is polled when it pushes none."""
    if worker.record.is_grpc:
        return LoadSource.GRPC_LOADS
    return LoadSource.LOADS if worker.record.engine == "sglang" else LoadSource.METRICS


def counts_server_load(worker: Worker) -> bool:
    """Whether `worker`'s engine may be read on vLLM's `/load` too: vLLM over HTTP, the
    whole engine and one rank (the count is the API server's, for every rank at once)."""
    record = worker.record
    return record.engine == "vllm" and not record.is_grpc and record.dp_size == 1


def apply_readings(
    worker: Worker, readings: Mapping[int, tuple[RankReading, float]], window_s: float
) -> bool:
    """Land `readings` (per rank: the reading and when it was taken) in `worker`'s engine
    shares: per rank for a rank-multiplexed worker, the record's own rank for a worker
    registered as one rank, else the whole engine (every rank read, or unknown). Returns
    whether every view is known."""
    record = worker.record
    shares = worker.shares
    if not shares:
        return False
    if record.rank_multiplexed:
        known = True
        for rank, share in enumerate(shares):
            got = readings.get(rank)
            if got is None:
                share.lose()
                known = False
            else:
                share.observe(got[0].total, got[1], worker.rank_inflight[rank], window_s)
        return known
    share = shares[0]
    if record.dp_rank is not None:
        got = readings.get(record.dp_rank)
    else:
        whole = whole_engine({rank: got[0] for rank, got in readings.items()}, record.dp_size)
        got = None if whole is None else (whole, min(taken for _, taken in readings.values()))
    if got is None:
        share.lose()
        return False
    share.observe(got[0].total, got[1], worker.inflight, window_s)
    return True


def _known(worker: Worker) -> bool:
    """Whether every view of `worker` holds a reading: what a first slow read in a row
    leaves standing (the reading then at most the interval plus the timeout old; a second
    slow read in a row makes it unknown). Dropping it at the first slow read of a busy
    engine would leave only this process's own count, far below the engine's when other
    replicas load it (docs/policies.md, "One load figure")."""
    return bool(worker.shares) and all(share.read_at is not None for share in worker.shares)


class _NotServed(Exception):
    """The engine does not serve the route asked (404)."""


class _Refused(Exception):
    """The engine answered the read with a status other than 200 and 404."""


@dataclass(slots=True)
class _Task:
    key: tuple[object, ...]
    scope: trio.CancelScope
    source: LoadSource
    server_load: bool = False
    """The engine's `/load` is proven and rules the load figure; the metrics poll then
    reads only the KV usage and adapter slots."""
    server_load_count: float | None = None
    """`/load`'s last count while it rules."""
    gauges_above: int = 0
    """Metrics readings in a row whose gauges held more than `/load`'s last count."""


class EngineLoads:
    """The running readers of a fleet; `statistics()` counts their reads by outcome."""

    def __init__(
        self, fleet: Fleet, settings: LoadReaderSettings, grpc: GrpcPool | None = None
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.grpc = grpc
        """Where a `grpc://` worker's `GetLoads` goes; None: its load stays unknown."""
        self.reads: dict[tuple[str, str], int] = {
            (source.value, outcome): 0 for source in LoadSource for outcome in OUTCOMES
        }
        self._tasks: dict[str, _Task] = {}
        self._seen_generation = -1

    def source_of(self, worker_id: str) -> LoadSource | None:
        """How the worker's load is read now; None when no reader runs for it."""
        task = self._tasks.get(worker_id)
        if task is None:
            return None
        return LoadSource.SERVER_LOAD if task.server_load else task.source

    def readers(self) -> int:
        return len(self._tasks)

    def statistics(self) -> dict[str, int]:
        return {f"{source}_{outcome}": count for (source, outcome), count in self.reads.items()}

    def _count(self, source: LoadSource, outcome: str) -> None:
        self.reads[(source.value, outcome)] += 1

    # -- reconciling -------------------------------------------------------------------

    def reconcile(self, nursery: trio.Nursery, http: httpx.AsyncClient, pool: UpstreamPool) -> None:
        """Start a reader for each worker that has none, and restart or stop those whose
        worker changed or left. O(workers), run only when the fleet changed."""
        if self.fleet.generation == self._seen_generation:
            return
        self._seen_generation = self.fleet.generation
        wanted: dict[str, tuple[tuple[object, ...], Worker]] = {}
        for worker in self.fleet.workers():
            record = worker.record
            key: tuple[object, ...] = (record.url, record.engine, record.dp_size, record.dp_rank)
            wanted[worker.id] = (key, worker)
        for worker_id, task in list(self._tasks.items()):
            want = wanted.get(worker_id)
            if want is None or want[0] != task.key:
                task.scope.cancel()
                del self._tasks[worker_id]
        for worker_id, (key, worker) in wanted.items():
            if worker_id not in self._tasks:
                scope = trio.CancelScope()
                task = self._tasks[worker_id] = _Task(key, scope, polled_source(worker))
                nursery.start_soon(self._run, worker, task, http, pool)

    async def _run(
        self, worker: Worker, task: _Task, http: httpx.AsyncClient, pool: UpstreamPool
    ) -> None:
        with task.scope:
            try:
                streams = await self._pushed_streams(worker, http)
                if streams:
                    task.source = LoadSource.STREAM
                    await self._follow_streams(worker, streams)
                elif self.settings.server_load_interval_s > 0 and counts_server_load(worker):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._poll, worker, task, pool)
                        nursery.start_soon(self._poll_server_load, worker, task, pool)
                else:
                    await self._poll(worker, task, pool)
            finally:
                # A worker that changed gets a new reader; until it reads, it is unknown.
                for share in worker.shares:
                    share.lose()
                worker.adapters.activity = None

    async def _pushed_streams(
        self, worker: Worker, http: httpx.AsyncClient
    ) -> tuple[EventEndpoint, ...]:
        """An SGLang engine's load publishers, from its server info; none for another
        engine, or when it advertises none or cannot say now (it is polled then)."""
        if worker.record.engine != "sglang" or worker.record.is_grpc:
            return ()
        api_key = worker.record.api_key or self.settings.worker_api_key or None
        try:
            answer = await ask_server_info(http, worker.url, self.settings.timeout_s, api_key)
        except FactsUnavailable as exc:
            log.info("%s: %s; its load is polled", worker.id, exc)
            return ()
        if answer.status != 200:
            return ()
        return load_event_endpoints(answer.body, worker.url)

    # -- polling -----------------------------------------------------------------------

    async def _poll(self, worker: Worker, task: _Task, pool: UpstreamPool) -> None:
        source = task.source
        settings = self.settings
        slow_reads = 0
        while True:
            taken_at = trio.current_time()
            outcome = "ok"
            readings: dict[int, RankReading] = {}
            try:
                with trio.fail_after(settings.timeout_s):
                    readings = await self._read(worker, source, pool)
            except _NotServed:
                if source is LoadSource.LOADS:
                    log.info("%s serves no /v1/loads: its load is read from /metrics", worker.id)
                    source = task.source = LoadSource.METRICS
                    continue
                outcome = "failed"
            except trio.TooSlowError:
                outcome = "timeout"
            except (
                _Refused,
                UpstreamError,
                LocalShortage,
                OSError,
                GrpcFactsUnavailable,
                GrpcMessagesMissing,
            ):
                outcome = "failed"
            except (BadReading, orjson.JSONDecodeError):
                outcome = "bad_answer"
            if outcome != "ok":
                worker.adapters.activity = None
            if task.server_load and readings:
                self._check_server_load(worker, task, readings)
            slow_reads = slow_reads + 1 if outcome == "timeout" else 0
            bridged = slow_reads == 1 and _known(worker)
            if not task.server_load and not bridged:
                known = apply_readings(
                    worker,
                    {rank: (got, taken_at) for rank, got in readings.items()},
                    settings.window_s,
                )
                if outcome == "ok" and not known:
                    outcome = "partial" if readings else "bad_answer"
            self._count(source, outcome)
            await trio.sleep_until(taken_at + settings.interval_s)

    async def _poll_server_load(self, worker: Worker, task: _Task, pool: UpstreamPool) -> None:
        """Read vLLM's `/load` until cancelled, and let it rule the load figure once a
        reading showed a request; a route the engine does not serve ends the task, a
        failed read or an engine that stopped counting hands the figure back to the
        metrics poll (unknown until its next reading)."""
        settings = self.settings
        undercounts = slow_reads = 0
        while True:
            taken_at = trio.current_time()
            count: float | None = None
            try:
                with trio.fail_after(settings.timeout_s):
                    count = server_load_count(orjson.loads(await self._get(worker, "/load", pool)))
            except _NotServed:
                log.info("%s serves no /load: its load is read from /metrics", worker.id)
                self._count(LoadSource.SERVER_LOAD, "failed")
                self._distrust_server_load(worker, task)
                return
            except trio.TooSlowError:
                outcome = "timeout"
            except (_Refused, UpstreamError, LocalShortage, OSError):
                outcome = "failed"
            except (BadReading, orjson.JSONDecodeError):
                outcome = "bad_answer"
            slow_reads = slow_reads + 1 if count is None and outcome == "timeout" else 0
            if count is None:
                if not (slow_reads == 1 and task.server_load and _known(worker)):
                    self._distrust_server_load(worker, task)
                    undercounts = 0
            elif not task.server_load and count == 0:
                outcome = "unproven"
            else:
                share = worker.shares[0] if worker.shares else None
                must_hold = (
                    0
                    if share is None
                    else share.counted_own(taken_at, worker.inflight, settings.server_load_window_s)
                )
                undercounts = undercounts + 1 if count < must_hold else 0
                if undercounts >= UNDERCOUNTS_TO_DISTRUST:
                    log.warning(
                        "%s: /load says %g while this router holds %d requests there the "
                        "engine has taken in; not trusted until it shows a request again "
                        "(its load is read from /metrics)",
                        worker.id,
                        count,
                        must_hold,
                    )
                    outcome = "bad_answer"
                    self._distrust_server_load(worker, task)
                    undercounts = 0
                else:
                    if not task.server_load:
                        log.info(
                            "%s counts its requests on /load: its load is read there", worker.id
                        )
                    task.server_load = True
                    task.server_load_count = count
                    outcome = "ok"
                    apply_readings(
                        worker,
                        {0: (RankReading(count, 0.0), taken_at)},
                        settings.server_load_window_s,
                    )
            self._count(LoadSource.SERVER_LOAD, outcome)
            await trio.sleep_until(taken_at + settings.server_load_interval_s)

    def _check_server_load(
        self, worker: Worker, task: _Task, readings: Mapping[int, RankReading]
    ) -> None:
        """Hold `/load` to the gauges: the API server holds every request its scheduler
        runs or queues, so gauges above its count for `UNDERCOUNTS_TO_DISTRUST` metrics
        readings in a row (one can be a race: each reading is of its own moment) are an
        engine that stopped counting, which this process could not see from its own
        requests (it has none there)."""
        whole = whole_engine(dict(readings), worker.record.dp_size)
        if whole is None or task.server_load_count is None:
            return
        task.gauges_above = task.gauges_above + 1 if whole.total > task.server_load_count else 0
        if task.gauges_above >= UNDERCOUNTS_TO_DISTRUST:
            log.warning(
                "%s: /load says %g while its gauges say %g running and waiting; not trusted "
                "until it shows a request again (its load is read from /metrics)",
                worker.id,
                task.server_load_count,
                whole.total,
            )
            self._count(LoadSource.SERVER_LOAD, "bad_answer")
            self._distrust_server_load(worker, task)

    @staticmethod
    def _distrust_server_load(worker: Worker, task: _Task) -> None:
        """`/load` no longer rules: the figure is unknown until the metrics poll reads."""
        task.server_load_count = None
        task.gauges_above = 0
        if task.server_load:
            task.server_load = False
            for share in worker.shares:
                share.lose()

    async def _read(
        self, worker: Worker, source: LoadSource, pool: UpstreamPool
    ) -> dict[int, RankReading]:
        if source is LoadSource.GRPC_LOADS:
            if self.grpc is None:
                raise GrpcMessagesMissing("this router has no gRPC pool")
            return await scheduler_loads(self.grpc, worker.url, self.settings.timeout_s)
        path = "/v1/loads" if source is LoadSource.LOADS else "/metrics"
        body = await self._get(worker, path, pool)
        if source is LoadSource.LOADS:
            return loads_readings(orjson.loads(body))
        text = body.decode("utf-8", "replace")
        # The adapter slots come with the same page (vLLM's `vllm:lora_requests_info`).
        worker.adapters.activity = adapter_activity(text)
        return metrics_readings(text, worker.record.engine)

    async def _get(self, worker: Worker, path: str, pool: UpstreamPool) -> bytes:
        """The body of `GET path` on the worker's engine, at most `max_answer_bytes`.
        Raises _NotServed (404), _Refused (another status but 200), BadReading (too
        large) or the pool's errors."""
        api_key = worker.record.api_key or self.settings.worker_api_key
        headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        limit = self.settings.max_answer_bytes
        async with pool.request(
            worker.url, "GET", path, headers, b"", connect_timeout_s=self.settings.timeout_s
        ) as response:
            if response.status == 404:
                raise _NotServed(path)
            if response.status != 200:
                raise _Refused(f"{path} answered {response.status}")
            whole = response.take_whole_body()
            parts = [] if whole is None else [whole]
            size = len(whole or b"")
            while whole is None and (chunk := await response.receive_some()):
                parts.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise BadReading(f"{path} is larger than {limit} bytes")
            if size > limit:
                raise BadReading(f"{path} is larger than {limit} bytes")
        return b"".join(parts)

    # -- pushed streams ----------------------------------------------------------------

    async def _follow_streams(self, worker: Worker, sources: tuple[EventEndpoint, ...]) -> None:
        latest: dict[int, tuple[RankReading, float]] = {}
        async with trio.open_nursery() as nursery:
            for source in sources:
                nursery.start_soon(self._follow_stream, worker, source, latest)

    async def _follow_stream(
        self,
        worker: Worker,
        source: EventEndpoint,
        latest: dict[int, tuple[RankReading, float]],
    ) -> None:
        settings = self.settings
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 64)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode() or LOAD_TOPIC)
            sub.connect(source.endpoint)
            fd = socket_fd(sub)
            while True:
                with trio.move_on_after(settings.silence_s) as quiet:
                    frames = await recv_multipart(sub, fd)
                if quiet.cancelled_caught:
                    outcome = "silent"
                    latest.pop(source.dp_rank, None)
                else:
                    try:
                        _, reading = load_message(frames)
                    except BadReading:
                        outcome = "bad_answer"
                        latest.pop(source.dp_rank, None)
                    else:
                        outcome = "ok"
                        latest[source.dp_rank] = (reading, trio.current_time())
                known = apply_readings(worker, latest, settings.window_s)
                self._count(LoadSource.STREAM, outcome if outcome != "ok" or known else "partial")
        finally:
            close_socket(sub)


async def serve_engine_loads(
    loads: EngineLoads,
    pool: UpstreamPool | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep one load reader per worker of `loads.fleet` running until cancelled. Reports
    `started()` once the readers of the fleet as it is are started (not read yet: until
    its first reading a worker's load is this process's own count).

    Cancellation: every reader stops, its sockets closed; each worker's engine share is
    unknown again.
    """
    settings = loads.settings
    async with AsyncExitStack() as owned:
        if pool is None:
            pool = await owned.enter_async_context(open_upstream_pool())
        async with (
            httpx.AsyncClient(timeout=settings.timeout_s) as http,
            trio.open_nursery() as nursery,
        ):
            loads.reconcile(nursery, http, pool)
            task_status.started()
            while True:
                await trio.sleep(settings.reconcile_s)
                loads.reconcile(nursery, http, pool)

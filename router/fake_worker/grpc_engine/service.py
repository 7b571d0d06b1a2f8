"""The fake engine's gRPC service: vLLM's `vllm.grpc.engine.VllmEngine`, from the published
protos (`smg-grpc-proto`), with the fake's deterministic tokens and scripted behaviour.

What a router over gRPC calls, and what it gets here:

- `Generate`: the prompt arrives as token ids (or text); the answer streams one chunk
  per generated token, the word `tok{k}` of the fake's tokenizer, then a `complete`
  with the finish reason and counts, in the shapes vLLM's servicer sends (a chunk holds
  its new tokens and their count; a streamed `complete` repeats the last chunk's
  tokens, a unary one holds them all). With `sampling_params.logprobs` set, each chunk
  and `complete` carries its tokens' `output_logprobs` as the servicer builds them:
  token `k`'s logprob is `output_logprob(k)`, and `logprobs` alternatives (the sampled
  token first, then the next words with lower logprobs). Requests vLLM refuses are INVALID_ARGUMENT with
  its messages: an empty prompt, a prompt longer than the context, a token id out of the
  vocabulary, `max_tokens` below 1, a DP rank out of range; a limit beyond the context is
  cut to what it holds. `n` above 128 is refused too, the fake's own bound.
- `Abort`: the named generations end at their next token with finish reason `abort`
  (a `complete` without tokens).
- `HealthCheck`: healthy once started (`startup_delay_s`) unless scripted unhealthy.
- `GetModelInfo` / `GetServerInfo`: the served model, the directory of its tokenizer
  (`tokenizer_files`), the context length, the DP size.
- `GetLoads`: each DP rank's running and waiting requests.
- `GetTokenizer`: the tokenizer files as one zip, in 64 KiB chunks, its SHA-256 last.
- `FlushCache`: the prefix cache emptied (a `cleared` event), always done.
- `SubscribeKvEvents`: with `kv_events`, the prefix cache's events from the subscription
  on, live, as vLLM's servicer relays them (`kv_events`): a non-zero start is
  OUT_OF_RANGE, a subscriber that falls behind (or a scripted loss) ends with DATA_LOSS.
  Without it, UNIMPLEMENTED with the servicer's message for KV events off.

With `cache_tokens`, a prefix cache (`router.fake_worker.prefix_cache`) serves each
Generate's prompt ids (a text prompt's: each word's id in the fake's vocabulary,
`tokenizer_files.word_id`) once the request runs, before its first token; what it held
is `cached_tokens` in every chunk and `complete` (0 without a cache).

Any other method is UNIMPLEMENTED (grpcio's own answer). A message that does not parse
is INTERNAL, gRPC's status for a request it cannot parse.

Scripted failures replace the answer of the first `fail_first` `Generate` calls:
`status` ends the call with `fail_status` as the servicer's code
(`status_codes.code_for_status`); `reset` sends `fail_after_chunks` chunks, then cuts
the client's connection with a TCP reset (`relay.ConnectionRelay.cut`); `hang` never
answers; `garbage` sends one message that is not protobuf; `midstream` sends
`fail_after_chunks` chunks and ends the call with `fail_status`'s code, as the servicer
ends a generation its engine failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import zipfile
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from router.fake_worker.behaviour import Behaviour, FailMode
from router.fake_worker.formats import MAX_CHOICES
from router.fake_worker.grpc_engine.kv_events import KvEventHub, SubscriptionLost
from router.fake_worker.grpc_engine.relay import ConnectionRelay
from router.fake_worker.grpc_engine.status_codes import code_for_status
from router.fake_worker.grpc_engine.tokenizer_files import (
    BOS_ID,
    EOS_ID,
    FILES,
    PAD_ID,
    VOCAB_SIZE,
    output_token_id,
    word_id,
)
from router.fake_worker.prefix_cache import PrefixCache, ids_prompt
from router.fake_worker.settings import FakeWorkerSettings
from router.fake_worker.stats import RankLoad, RoutingStats

SERVICE = "vllm.grpc.engine.VllmEngine"
GENERATE = f"/{SERVICE}/Generate"
# A GenerateResponse whose first field claims 127 bytes and holds fewer: no client can
# parse it.
GARBAGE = b"\x0a\x7ffake engine: this message is deliberately not protobuf"
# vLLM's running window (`--max-num-seqs`) when the fake sets no concurrency limit.
MAX_NUM_SEQS = 128
TOKENIZER_CHUNK = 64 * 1024
ABORT_HISTORY = 100
# How a text prompt splits into tokens: the tokenizer's pre-tokenizer (`Whitespace`).
_WORDS = re.compile(r"\w+|[^\w\s]+")
# vLLM's servicer's answers to SubscribeKvEvents it cannot serve.
KV_EVENTS_OFF = (
    "KV cache events not enabled. Start vLLM with --kv-events-config "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\''
)
REPLAY_REFUSED = "KV event replay cursors are per subscription; resubscribe with zero and rebuild"

Pause = Callable[[float, asyncio.Event], Awaitable[None]]
M = TypeVar("M", bound=Message)


class BadRequest(ValueError):
    """A Generate request vLLM refuses (INVALID_ARGUMENT); the message says why."""


async def pause_unless_aborted(seconds: float, aborted: asyncio.Event) -> None:
    """Wait `seconds`, or less when the generation is aborted meanwhile."""
    if seconds <= 0 or aborted.is_set():
        return
    try:
        await asyncio.wait_for(aborted.wait(), seconds)
    except TimeoutError:
        pass


@dataclass(frozen=True, slots=True)
class Plan:
    """One accepted Generate request: what to produce."""

    request_id: str
    rank: int
    prompt_tokens: int
    tokens: int  # per choice
    n: int
    stream: bool
    explicit_limit: bool
    logprobs: int | None = None
    """Alternatives per token's logprob; None: the request asked for no logprobs."""
    prompt_ids: tuple[int, ...] = ()
    """The prompt as token ids (a text prompt's words' ids), what the prefix cache sees."""

    @property
    def finish_reason(self) -> str:
        return "length" if self.explicit_limit else "stop"


def plan_generation(
    request: vllm_engine_pb2.GenerateRequest,
    default_tokens: int,
    dp_size: int,
    max_model_len: int,
) -> Plan:
    """Validate a request as vLLM does; raise BadRequest for what it refuses."""
    kind = request.WhichOneof("input")
    ids: tuple[int, ...]
    if kind == "tokenized":
        ids = tuple(request.tokenized.input_ids)
        for token_id in ids:
            if token_id >= VOCAB_SIZE:
                raise BadRequest(f"Token id {token_id} is out of vocabulary")
    elif kind == "text":
        ids = tuple(word_id(word) for word in _WORDS.findall(request.text))
    else:
        ids = ()
    prompt = len(ids)
    if prompt == 0:
        raise BadRequest("The decoder prompt cannot be empty")
    if prompt > max_model_len:
        raise BadRequest(
            f"The decoder prompt (length {prompt}) is longer than the maximum model length "
            f"of {max_model_len}."
        )
    params = request.sampling_params
    explicit = params.HasField("max_tokens")
    if explicit and params.max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {params.max_tokens}.")
    # A limit beyond the context is cut to what the context holds, as vLLM's engine does
    # (its HTTP server refuses it; its gRPC servicer does not).
    tokens = min(params.max_tokens, max_model_len - prompt) if explicit else default_tokens
    n = params.n or 1
    if n > MAX_CHOICES:
        raise BadRequest(f"n must be at most {MAX_CHOICES}, got {n}.")
    rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else 0
    if not 0 <= rank < dp_size:
        raise BadRequest(
            f"data_parallel_rank {request.data_parallel_rank} is out of range [0, {dp_size})."
        )
    logprobs = params.logprobs if params.HasField("logprobs") else None
    return Plan(
        request.request_id, rank, prompt, tokens, n, request.stream, explicit, logprobs, ids
    )


def _serialize(message: Message | bytes) -> bytes:
    """Messages as protobuf; bytes (the `garbage` failure) as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def _unparsed(raw: bytes) -> bytes:
    return raw


class FakeVllmEngine:
    """The state of one fake gRPC engine (behaviour, counters, loads) and its RPCs.

    Build it inside the event loop that serves it. `pause` is how generation waits
    (time to first token, between tokens); `now` reads the loop's clock. Tests inject
    both.
    """

    def __init__(
        self,
        settings: FakeWorkerSettings,
        model_dir: Path,
        relay: ConnectionRelay | None = None,
        *,
        pause: Pause = pause_unless_aborted,
        now: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.relay = relay
        self.behaviour: Behaviour = settings.behaviour()
        self.routing = RoutingStats(settings.dp_size)
        self.aborts = 0
        self.aborted: deque[str] = deque(maxlen=ABORT_HISTORY)
        self._pause = pause
        self._now = now or asyncio.get_running_loop().time
        self.started_at = self._now()
        self._running: dict[str, asyncio.Event] = {}
        self._limiter = (
            asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency > 0 else None
        )
        self._tokenizer_zip: tuple[bytes, str] | None = None
        self.last_receive = 0.0
        self._changed = asyncio.Event()
        self.prefix_cache = (
            PrefixCache(settings.cache_tokens) if settings.cache_tokens > 0 else None
        )
        self.kv_events: KvEventHub | None = None
        if settings.publishes_kv_events and self.prefix_cache is not None:
            self.kv_events = KvEventHub()
            self.prefix_cache.listener = self.kv_events

    def _notify(self) -> None:
        """Wake whoever waits in `wait_until`: a generation began, queued, ran or ended,
        a KV-event subscription began or ended."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, holds: Callable[[], bool]) -> None:
        """Return once `holds()` is true, looking again at every change of the loads (a
        test's gate for "this many in flight"); the caller bounds the wait."""
        while not holds():
            await self._changed.wait()

    # -- the service --------------------------------------------------------------------

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The service's methods for `grpc.aio.Server.add_generic_rpc_handlers`. Requests
        arrive as bytes and are parsed here, so a malformed one gets a status of ours."""
        pb, common = vllm_engine_pb2, common_pb2

        def unary(
            name: str,
            fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]],
            kind: type[M],
        ) -> grpc.RpcMethodHandler:
            async def behaviour(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
                self.routing.count_path(f"/{SERVICE}/{name}")
                return await fn(await _parse(kind, raw, context), context)

            return grpc.unary_unary_rpc_method_handler(
                behaviour, request_deserializer=_unparsed, response_serializer=_serialize
            )

        def streaming(
            name: str,
            fn: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Message]],
            kind: type[M],
        ) -> grpc.RpcMethodHandler:
            async def behaviour(
                raw: bytes, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Message]:
                self.routing.count_path(f"/{SERVICE}/{name}")
                async for reply in fn(await _parse(kind, raw, context), context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(
                behaviour, request_deserializer=_unparsed, response_serializer=_serialize
            )

        generate = grpc.unary_stream_rpc_method_handler(
            self.generate, request_deserializer=_unparsed, response_serializer=_serialize
        )
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": generate,
                "Abort": unary("Abort", self.abort, pb.AbortRequest),
                "HealthCheck": unary("HealthCheck", self.health_check, pb.HealthCheckRequest),
                "GetModelInfo": unary("GetModelInfo", self.get_model_info, pb.GetModelInfoRequest),
                "GetServerInfo": unary(
                    "GetServerInfo", self.get_server_info, pb.GetServerInfoRequest
                ),
                "GetLoads": unary("GetLoads", self.get_loads, pb.GetLoadsRequest),
                "FlushCache": unary("FlushCache", self.flush_cache, common.FlushCacheRequest),
                "GetTokenizer": streaming(
                    "GetTokenizer", self.get_tokenizer, common.GetTokenizerRequest
                ),
                "SubscribeKvEvents": grpc.unary_stream_rpc_method_handler(
                    self.subscribe_kv_events,
                    request_deserializer=_unparsed,
                    response_serializer=_serialize,
                ),
            },
        )

    def ready(self) -> bool:
        """Whether HealthCheck says healthy now: started, and not scripted unhealthy."""
        loaded = self._now() - self.started_at >= self.settings.startup_delay_s
        return loaded and self.behaviour.healthy

    # -- Generate -----------------------------------------------------------------------

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        """One Generate call: counted as a dispatch whatever it holds, then answered, each
        reply written before the next (`context.write`), so a scripted reset lands after
        the chunks it follows.

        Cancellation (the client left or its deadline passed): generation stops at once
        and the call is counted in `disconnects`.
        """
        stats = self.routing
        stats.count_path(GENERATE)
        self.last_receive = self._now()
        request: vllm_engine_pb2.GenerateRequest | None
        try:
            request = vllm_engine_pb2.GenerateRequest.FromString(raw)
        except DecodeError:
            request = None
        pinned = request is not None and request.HasField("data_parallel_rank")
        stats.count_dispatch(
            GENERATE, str(request.data_parallel_rank) if request and pinned else None, None
        )
        stats.record_headers(_metadata(context))
        stats.begin()
        self._notify()
        try:
            await self._answer(raw, request, context)
        except asyncio.CancelledError:
            stats.disconnects += 1
            raise
        finally:
            stats.end()
            self._notify()

    async def _answer(
        self,
        raw: bytes,
        request: vllm_engine_pb2.GenerateRequest | None,
        context: grpc.aio.ServicerContext,
    ) -> None:
        behaviour = self.behaviour
        if behaviour.take_failure():
            self.routing.failures += 1
            await self._fail(request, context)
            return
        if request is None:
            await _parse(vllm_engine_pb2.GenerateRequest, raw, context)
            return
        try:
            plan = plan_generation(
                request, behaviour.tokens, self.settings.dp_size, self.settings.max_model_len
            )
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        load = self.routing.loads[plan.rank]
        limiter = self._limiter
        if limiter is not None:
            load.queued += 1
            self._notify()
            try:
                await limiter.acquire()
            finally:
                load.queued -= 1
        aborted = asyncio.Event()
        self._running[plan.request_id] = aborted
        load.running += 1
        load.prompt_tokens += plan.prompt_tokens
        self._notify()
        try:
            cached = 0
            if self.prefix_cache is not None:
                cached = self.prefix_cache.serve(ids_prompt(plan.prompt_ids))
                load.cached_tokens += cached
            await self._tokens(plan, cached, load, aborted, context)
        finally:
            load.running -= 1
            if self._running.get(plan.request_id) is aborted:
                del self._running[plan.request_id]
            if limiter is not None:
                limiter.release()

    async def _tokens(
        self,
        plan: Plan,
        cached: int,
        load: RankLoad,
        aborted: asyncio.Event,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The chunks (streaming) and the `complete` of each choice, paced; `cached` is
        the prompt's tokens the prefix cache held."""
        behaviour = self.behaviour
        produced = 0
        finish = plan.finish_reason
        await self._pause(behaviour.ttft_ms / 1000, aborted)
        for k in range(plan.tokens):
            if k:
                await self._pause(behaviour.token_latency_ms / 1000, aborted)
            if aborted.is_set():
                finish = "abort"
                break
            produced += 1
            load.generation_tokens += plan.n
            if plan.stream:
                for index in range(plan.n):
                    chunk = _chunk([output_token_id(k)], plan.prompt_tokens, index, cached)
                    _add_logprobs(chunk.chunk.output_logprobs, [k], plan.logprobs)
                    await context.write(chunk)
        if plan.stream:
            # The last chunk's tokens again; none after an abort, as vLLM's servicer sends.
            last = [produced - 1] if produced and finish != "abort" else []
            for index in range(plan.n):
                ids = [output_token_id(k) for k in last]
                complete = _complete(ids, finish, plan.prompt_tokens, index, cached)
                _add_logprobs(complete.complete.output_logprobs, last, plan.logprobs)
                await context.write(complete)
        else:
            ids = [output_token_id(k) for k in range(produced)]
            for index in range(plan.n):
                complete = _complete(ids, finish, plan.prompt_tokens, index, cached)
                _add_logprobs(complete.complete.output_logprobs, range(produced), plan.logprobs)
                await context.write(complete)

    async def _fail(
        self, request: vllm_engine_pb2.GenerateRequest | None, context: grpc.aio.ServicerContext
    ) -> None:
        """The scripted failure in place of an answer (see the module's docstring)."""
        behaviour = self.behaviour
        mode = behaviour.fail_mode
        status = behaviour.fail_status
        message = f"scripted failure: fake worker answers {status}"
        if mode in (FailMode.RESET, FailMode.MIDSTREAM) and request is not None and request.stream:
            prompt = len(request.tokenized.input_ids)
            for k in range(behaviour.fail_after_chunks):
                if k:
                    await self._pause(behaviour.token_latency_ms / 1000, asyncio.Event())
                await context.write(_chunk([output_token_id(k)], prompt, 0, 0))
        if mode is FailMode.STATUS or mode is FailMode.MIDSTREAM:
            await context.abort(code_for_status(status), message)
        elif mode is FailMode.RESET:
            peer = context.peer()
            if self.relay is None or not await self.relay.cut(peer):
                # No relay in front (an in-process server): the nearest a call can say.
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        elif mode is FailMode.HANG:
            await asyncio.Event().wait()
        else:
            await context.write(GARBAGE)

    # -- the other RPCs -----------------------------------------------------------------

    async def abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        for request_id in request.request_ids:
            self.aborts += 1
            self.aborted.append(request_id)
            running = self._running.get(request_id)
            if running is not None:
                running.set()
        return vllm_engine_pb2.AbortResponse()

    async def health_check(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        if self.ready():
            return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")
        why = "scripted unhealthy" if not self.behaviour.healthy else "still loading"
        return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=why)

    async def get_model_info(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        settings = self.settings
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(self.model_dir),
            tokenizer_path=str(self.model_dir),
            is_generation=True,
            max_context_length=settings.max_model_len,
            max_req_input_len=settings.max_model_len,
            vocab_size=VOCAB_SIZE,
            served_model_name=settings.model,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            eos_token_ids=[EOS_ID],
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
        )

    async def get_server_info(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=self.routing.inflight,
            is_paused=False,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=self._now() - self.started_at,
            data_parallel_size=self.settings.dp_size,
            kv_cache_dtype="auto",
            max_num_seqs=self._max_running(),
        )

    async def get_loads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        ranks: Iterable[int] = range(self.settings.dp_size)
        if request.HasField("dp_rank"):
            if not 0 <= request.dp_rank < self.settings.dp_size:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"dp_rank {request.dp_rank} is out of range [0, {self.settings.dp_size}).",
                )
            ranks = (request.dp_rank,)
        capacity = self._max_running()
        loads = []
        for rank in ranks:
            load = self.routing.loads[rank]
            loads.append(
                vllm_engine_pb2.SchedulerLoad(
                    dp_rank=rank,
                    num_running_reqs=load.running,
                    num_waiting_reqs=load.queued,
                    num_total_reqs=load.running + load.queued,
                    token_usage=min(1.0, load.running / capacity),
                    max_running_requests=capacity,
                )
            )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),  # wall-clock: the field names a time of day
            version="fake",
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def flush_cache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        if self.prefix_cache is None:
            return common_pb2.FlushCacheResponse(success=True, message="nothing cached")
        self.prefix_cache.clear()
        return common_pb2.FlushCacheResponse(success=True, message="cache flushed")

    async def get_tokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        data, digest = self._tokenizer_bundle()
        offsets = range(0, len(data), TOKENIZER_CHUNK)
        for offset in offsets:
            last = offset == offsets[-1]
            yield common_pb2.GetTokenizerChunk(
                data=data[offset : offset + TOKENIZER_CHUNK], sha256=digest if last else ""
            )

    async def subscribe_kv_events(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        """One SubscribeKvEvents call, as vLLM's servicer answers it (`kv_events`): the
        headers once subscribed (a client's `initial_metadata()` returns when it is), then
        every batch published after, each written before the next is taken.

        Cancellation (the client left or its deadline passed): the subscription and its
        queue are gone at once.
        """
        self.routing.count_path(f"/{SERVICE}/SubscribeKvEvents")
        request = await _parse(common_pb2.SubscribeKvEventsRequest, raw, context)
        hub = self.kv_events
        if hub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, KV_EVENTS_OFF)
            return
        if request.start_sequence_number:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, REPLAY_REFUSED)
            return
        try:
            with hub.subscribe() as subscription:
                self._notify()
                await context.send_initial_metadata(())
                while True:
                    try:
                        batch = await subscription.next_batch()
                    except SubscriptionLost as exc:
                        await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
                        return
                    await context.write(batch)
        finally:
            self._notify()

    def _tokenizer_bundle(self) -> tuple[bytes, str]:
        """The tokenizer files as one zip and its SHA-256, built once (a few KiB)."""
        if self._tokenizer_zip is None:
            buffer = io.BytesIO()
            with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
                for name in FILES:
                    bundle.write(self.model_dir / name, name)
            data = buffer.getvalue()
            self._tokenizer_zip = (data, hashlib.sha256(data).hexdigest())
        return self._tokenizer_zip

    def _max_running(self) -> int:
        return self.settings.max_concurrency or MAX_NUM_SEQS

    # -- debug --------------------------------------------------------------------------

    def routing_json(self) -> dict[str, Any]:
        """`GET /debug/routing` on the side port: the HTTP fake's counters, plus aborts,
        the connections the relay took and cut, and the KV-event publisher's figures
        (`kv_events`, null without `--kv-events`)."""
        answer = self.routing.to_json()
        answer["aborts"] = self.aborts
        answer["aborted"] = list(self.aborted)
        if self.relay is not None:
            answer["connections"] = self.relay.connections
            answer["resets"] = self.relay.cuts
        hub = self.kv_events
        answer["kv_events"] = None if hub is None else hub.statistics().to_json()
        return answer

    def reset_counters(self) -> None:
        self.routing.reset()
        self.aborts = 0
        self.aborted.clear()
        if self.kv_events is not None:
            self.kv_events.reset_counters()


async def _parse(kind: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
    """`raw` as a `kind` message; a message that does not parse ends the call INTERNAL."""
    try:
        return kind.FromString(raw)
    except DecodeError as exc:
        await context.abort(
            grpc.StatusCode.INTERNAL, f"cannot parse {kind.DESCRIPTOR.full_name}: {exc}"
        )
        raise  # abort raises; this keeps the type checker sure


def _chunk(
    ids: list[int], prompt_tokens: int, index: int, cached_tokens: int
) -> vllm_engine_pb2.GenerateResponse:
    return vllm_engine_pb2.GenerateResponse(
        chunk=vllm_engine_pb2.GenerateStreamChunk(
            token_ids=ids,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(ids),
            cached_tokens=cached_tokens,
            index=index,
        )
    )


def output_logprob(k: int) -> float:
    """The logprob of the fake's `k`-th generated token: a few distinct values."""
    return -0.125 * (1 + k % 5)


def _add_logprobs(proto: Any, positions: Iterable[int], count: int | None) -> None:
    """Fill an `OutputLogProbs` for the tokens at `positions` (nothing when `count` is
    None): each token's logprob and, with `count` above 0, `count` alternatives, the
    sampled token first (the servicer's order), then the next words, each less likely."""
    if count is None:
        return
    for k in positions:
        proto.token_ids.append(output_token_id(k))
        proto.token_logprobs.append(output_logprob(k))
        if count > 0:
            top = proto.top_logprobs.add()
            for rank in range(count):
                top.token_ids.append(output_token_id(k + rank))
                top.values.append(output_logprob(k) - rank)


def _complete(
    ids: list[int], finish_reason: str, prompt_tokens: int, index: int, cached_tokens: int
) -> vllm_engine_pb2.GenerateResponse:
    return vllm_engine_pb2.GenerateResponse(
        complete=vllm_engine_pb2.GenerateComplete(
            output_ids=ids,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(ids),
            cached_tokens=cached_tokens,
            index=index,
        )
    )


def _metadata(context: grpc.aio.ServicerContext) -> list[tuple[bytes, bytes]]:
    """The call's metadata as header pairs (binary values as they are)."""
    pairs = []
    for key, value in context.invocation_metadata() or ():
        raw = value if isinstance(value, bytes) else str(value).encode("latin-1", "replace")
        pairs.append((str(key).encode("latin-1", "replace"), raw))
    return pairs

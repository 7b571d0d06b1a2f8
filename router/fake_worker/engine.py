"""A fake inference engine: the HTTP handler of one fake worker and the task that serves it.

`FakeWorker(settings).handler` speaks the engine API (OpenAI chat/completions, the
Responses API, Anthropic Messages, SGLang `/generate`, embeddings and the other pooling
routes, info endpoints, `/metrics`) plus the `/debug/*` endpoints tests drive it with.
Generation produces `tok0 tok1 ...` at the scripted pace; scripted failures replace the
answer of the first `fail_first` requests of any model route. With LoRA adapters
(`--engine vllm`) a request may name one it holds, and waits for an adapter slot as
vLLM's would (`router.fake_worker.lora`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
import trio

import router.fake_worker.info as info
from router.api.errors import answer_refusal
from router.fake_worker.apis import (
    GENERATION_PATHS,
    REQUEST_ID_PREFIX,
    paced_events,
    parse_request,
    render_unary,
    stream_frames,
)
from router.fake_worker.behaviour import Behaviour, FailMode, InvalidBehaviour
from router.fake_worker.failures import (
    JSON_HEADERS,
    SSE_HEADERS,
    break_stream,
    break_unary,
    error_body,
    error_body_for,
    serve_failure,
    vllm_error_body,
)
from router.fake_worker.formats import Api, BadGenerationRequest, Generation
from router.fake_worker.lora import AdapterSlots, model_cards
from router.fake_worker.metrics import render_metrics
from router.fake_worker.pooling import POOLING_ROUTES
from router.fake_worker.pooling_server import PoolingService
from router.fake_worker.prefix_cache import PrefixCache, tokenize
from router.fake_worker.settings import FakeWorkerSettings
from router.fake_worker.stats import RankLoad, RoutingStats
from router.http.server.loop import serve_http
from router.http.server.messages import ClientDisconnected, Headers, Request, ResponseWriter
from router.http.server.settings import ServerSettings

if TYPE_CHECKING:
    from router.fake_worker.model_tokens import ModelTokens

TEXT_HEADERS: Headers = ((b"content-type", b"text/plain; charset=utf-8"),)
METRICS_HEADERS: Headers = ((b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),)
RANK_HEADER = b"x-data-parallel-rank"

Route = Callable[[Request, ResponseWriter], Awaitable[None]]


async def _respond_json(writer: ResponseWriter, status: int, payload: object) -> None:
    await writer.respond(status, JSON_HEADERS, orjson.dumps(payload))


async def _bad_request(writer: ResponseWriter, message: str, path: str = "") -> None:
    await writer.respond(
        400, JSON_HEADERS, error_body_for(path, message, "invalid_request_error", 400)
    )


def _vllm_models(listing: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """`GET /v1/models` as vLLM lists a model: its `max_model_len`, `parent` (null: a base
    model; an adapter's names its base model, and has no `max_model_len` of its own) and
    one permission object."""
    data = []
    for model in listing["data"]:
        permission = {
            "id": f"modelperm-{model['id']}",
            "object": "model_permission",
            "created": model["created"],
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        parent = model.get("parent")
        data.append(
            {
                **model,
                "parent": parent,
                "max_model_len": max_model_len if parent is None else None,
                "permission": [permission],
            }
        )
    return {**listing, "data": data}


def _json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; an empty one for anything else."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def _json_error_position(raw: bytes) -> int:
    """Where a body that is not JSON stops being JSON (vLLM names it in `param`)."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return exc.pos
    return 0


def _model_tokens(settings: FakeWorkerSettings) -> ModelTokens | None:
    if not settings.tokenizer:
        return None
    # Imported only here: the model's tokenizer and templates cost a fake that counts
    # bytes a share of its start.
    from router.fake_worker.model_tokens import ModelTokens

    return ModelTokens(settings.tokenizer)


class FakeWorker:
    """One fake engine: its settings, live behaviour, counters and HTTP handler.

    Build it inside a trio run: the startup delay counts from construction (or from
    `started_at`, on trio's clock).
    """

    def __init__(self, settings: FakeWorkerSettings, *, started_at: float | None = None) -> None:
        self.settings = settings
        self.behaviour: Behaviour = settings.behaviour()
        self.routing = RoutingStats(settings.dp_size)
        self.started_at = trio.current_time() if started_at is None else started_at
        self.port = settings.port
        self._limiter = (
            trio.Semaphore(settings.max_concurrency) if settings.max_concurrency > 0 else None
        )
        self._next_id = 0
        self.prefix_cache = (
            PrefixCache(settings.cache_tokens) if settings.cache_tokens > 0 else None
        )
        self._held: trio.Event | None = None
        self._held_waiting = 0
        self._held_until: int | None = None
        self._model_tokens = _model_tokens(settings)
        # What the load gauges show while they step (`gauge_step_ms`): the counts of the
        # step before, and of this one to show at the next.
        self._shown: list[tuple[int, int]] | None = None
        self._next_shown: list[tuple[int, int]] | None = None
        self.load_port_base: int | None = None
        """The first port of the load publishers once they listen (rank r at base + r);
        `/server_info` advertises it."""
        self.kv_endpoints: tuple[str, str | None] | None = None
        """The KV-event publisher's PUB and replay endpoints once it listens (whoever
        starts the publisher sets them); `/kv_event_sources` lists them."""
        self._vllm = settings.engine == "vllm"
        listing = info.models(settings)
        self._models_body = orjson.dumps(
            _vllm_models(listing, settings.max_model_len) if self._vllm else listing
        )
        self.adapter_slots = AdapterSlots(settings.max_loras) if settings.serves_lora else None
        """The adapters running and waiting (None: an engine run without LoRA)."""
        self.adapter_roots: dict[str, str] = {}
        """Where each adapter loaded at run time came from (`lora_path`)."""
        self._model_info_body = orjson.dumps(info.model_info(settings))
        self._routes: dict[str, tuple[frozenset[str], Route]] = {}
        get, post = frozenset({"GET", "HEAD"}), frozenset({"POST", "PUT"})
        for path in GENERATION_PATHS:
            self._routes[path] = (post, self._generate)
        pooling = PoolingService(settings, self.behaviour, self.routing, self._model_tokens)
        for path in POOLING_ROUTES:
            self._routes[path] = (post, pooling.serve)
        for path, route in (
            ("/health", self._health),
            ("/health_generate", self._health),
            ("/v1/models", self._models),
            ("/get_model_info", self._model_info),
            ("/model_info", self._model_info),
            ("/version", self._version),
            ("/v1/loads", self._loads),
            ("/loads", self._loads),
            ("/get_load", self._legacy_load),
            ("/metrics", self._metrics),
            ("/debug/routing", self._debug_routing),
        ):
            self._routes[path] = (get, route)
        # What tells the engines apart (router.engines.facts): SGLang serves its
        # server info; vLLM serves neither path, and lists its KV-event publishers.
        if settings.engine == "sglang":
            self._routes["/get_server_info"] = (get, self._server_info)
            self._routes["/server_info"] = (get, self._server_info)
        else:
            self._routes["/kv_event_sources"] = (get, self._kv_event_sources)
            self._routes["/load"] = (get, self._server_load)
        if settings.runtime_lora_updating:
            self._routes["/v1/load_lora_adapter"] = (post, self._load_adapter)
            self._routes["/v1/unload_lora_adapter"] = (post, self._unload_adapter)
        self._routes["/debug/behaviour"] = (get | post, self._debug_behaviour)
        self._routes["/debug/reset"] = (post, self._debug_reset)
        self._routes["/flush_cache"] = (get | post, self._flush_cache)

    @property
    def url(self) -> str:
        host = self.settings.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def ready(self, now: float) -> bool:
        """Whether `/health` answers 200 at `now`: loaded, and not scripted unhealthy."""
        return now - self.started_at >= self.settings.startup_delay_s and self.behaviour.healthy

    async def handler(self, request: Request, writer: ResponseWriter) -> None:
        """Answer one request. Cancellation (the client left): generation stops at once and
        the request is counted in `disconnects`; nothing else is left behind."""
        path = request.path
        if not path.startswith("/debug/"):
            self.routing.count_path(path)
        route = self._routes.get(path)
        if route is None:
            await writer.respond(
                404, JSON_HEADERS, error_body(f"no route for {path}", "invalid_request_error", 404)
            )
            return
        methods, serve = route
        if request.method not in methods:
            await writer.respond(
                405,
                (*JSON_HEADERS, (b"allow", ", ".join(sorted(methods)).encode())),
                error_body(
                    f"{request.method} is not allowed on {path}", "invalid_request_error", 405
                ),
            )
            return
        await serve(request, writer)

    # -- generation ---------------------------------------------------------------------

    async def _generate(self, request: Request, writer: ResponseWriter) -> None:
        stats = self.routing
        raw_rank = request.header(RANK_HEADER)
        rank_text = None if raw_rank is None else raw_rank.decode("latin-1")
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        stats.count_dispatch(request.path, rank_text, body)
        stats.record_headers(request.headers)
        stats.begin()
        try:
            await self._serve_generation(request, writer, body, rank_text)
        except ClientDisconnected:
            stats.disconnects += 1
        except trio.Cancelled:
            if request.client_gone:
                stats.disconnects += 1
            raise
        finally:
            stats.end()

    async def _serve_generation(
        self, request: Request, writer: ResponseWriter, body: object, rank_text: str | None
    ) -> None:
        behaviour = self.behaviour
        if behaviour.take_failure():
            self.routing.failures += 1
            streaming = isinstance(body, dict) and body.get("stream") is True
            await self._fail(request, writer, streaming, body)
            return
        vllm = self.settings.engine == "vllm" and request.path != "/v1/messages"
        if body is None:
            if vllm:
                position = _json_error_position(request.body)
                await self._refuse(
                    writer,
                    request.path,
                    BadGenerationRequest(
                        f"the request body is not valid JSON (at {position})",
                        param=f"body.{position}",
                    ),
                )
            else:
                await _bad_request(writer, "the request body is not valid JSON", request.path)
            return
        rank = self._rank(rank_text)
        if rank is None:
            await _bad_request(
                writer,
                f"X-Data-Parallel-Rank must be an integer in [0, {self.settings.dp_size}), "
                f"got {rank_text!r}",
                request.path,
            )
            return
        api = GENERATION_PATHS[request.path]
        # vLLM's order: its request schema first, then the model, then the sampling checks.
        unknown_model = self._unknown_model(body) if vllm else None
        try:
            gen = parse_request(
                api,
                body,
                behaviour.tokens,
                self.settings.model,
                max_model_len=self.settings.max_model_len if vllm else None,
            )
        except BadGenerationRequest as exc:
            if unknown_model is not None and exc.refused:
                await writer.respond(404, JSON_HEADERS, unknown_model)
            else:
                await self._refuse(writer, request.path, exc)
            return
        if unknown_model is not None:
            await writer.respond(404, JSON_HEADERS, unknown_model)
            return
        adapter = self._adapter_of(body)
        gen = self._prefill(api, body, gen, adapter)
        load = self.routing.loads[rank]
        limiter = self._limiter
        slots = self.adapter_slots if adapter is not None else None
        if limiter is not None or slots is not None:
            load.queued += 1
            try:
                await self._admit(limiter, slots, adapter)
            finally:
                load.queued -= 1
        load.running += 1
        load.prompt_tokens += gen.prompt_tokens
        load.cached_tokens += gen.cached_tokens or 0
        try:
            held = self._held
            if held is not None:
                self._held_waiting += 1
                if self._held_until is not None and self._held_waiting >= self._held_until:
                    self.release_answers()
                await held.wait()
            if gen.stream:
                await self._stream(writer, gen, load)
            else:
                await self._unary(writer, gen, load)
        finally:
            load.running -= 1
            if limiter is not None:
                limiter.release()
            if slots is not None and adapter is not None:
                slots.release(adapter)

    @staticmethod
    async def _admit(
        limiter: trio.Semaphore | None, slots: AdapterSlots | None, adapter: str | None
    ) -> None:
        """Wait for an adapter slot, then for a place under `--max-concurrency`.
        Cancellation: neither is held."""
        if slots is not None and adapter is not None:
            await slots.acquire(adapter)
        if limiter is None:
            return
        try:
            await limiter.acquire()
        except BaseException:
            if slots is not None and adapter is not None:
                slots.release(adapter)
            raise

    def _adapter_of(self, body: object) -> str | None:
        """The LoRA adapter a request names, when the engine holds it; else None (the base
        model, or a name already refused)."""
        if self.adapter_slots is None or not isinstance(body, dict):
            return None
        model = body.get("model")
        return model if isinstance(model, str) and model in self.behaviour.lora_adapters else None

    def _live_counts(self) -> list[tuple[int, int]]:
        counts = [(load.running, load.queued) for load in self.routing.loads]
        running, queued = counts[0]
        counts[0] = (running + self.behaviour.external_load, queued)
        return counts

    def gauge_loads(self) -> list[RankLoad]:
        """Per rank, the load the gauges show: the requests it runs and queues (with
        another sender's on rank 0, `external_load`), live or as of the step before
        (`gauge_step_ms`); token counters are always live."""
        shown = self._shown if self._shown is not None else self._live_counts()
        return [
            dataclasses.replace(load, running=running, queued=queued)
            for load, (running, queued) in zip(self.routing.loads, shown, strict=True)
        ]

    async def step_gauges(self) -> None:
        """Refresh the gauges once per `gauge_step_ms` until cancelled: each step shows
        the counts taken at the step before, as an engine's scheduler reports its last
        step's state."""
        step_s = self.settings.gauge_step_ms / 1000
        self._shown = self._next_shown = self._live_counts()
        while True:
            await trio.sleep(step_s)
            self._shown, self._next_shown = self._next_shown, self._live_counts()

    def hold_answers(self, until: int | None = None) -> None:
        """From now on generation requests wait, in flight, until `release_answers`, or
        with `until` until that many wait: an in-process test's gate for "a whole burst
        in flight at once" that no machine load opens early, as a long time to first
        token would."""
        if self._held is None:
            self._held = trio.Event()
            self._held_waiting = 0
        self._held_until = until

    def release_answers(self) -> None:
        """Every held request goes on, and new ones are no longer held."""
        if self._held is not None:
            self._held.set()
            self._held = None
            self._held_until = None

    def _prefill(
        self, api: Api, body: object, gen: Generation, adapter: str | None = None
    ) -> Generation:
        """The prompt as the prefix cache sees it (an adapter's blocks apart from the base
        model's and every other adapter's): its tokens, those cached, the prefill time."""
        cached = None
        tokens = gen.prompt_tokens
        if self.prefix_cache is not None:
            prompt = self._model_tokens.prompt(api.value, body) if self._model_tokens else None
            if prompt is None:
                prompt = tokenize(api.value, body)
            tokens, cached = prompt.tokens, self.prefix_cache.serve(prompt, adapter)
        prefill_s = (tokens - (cached or 0)) * self.settings.prefill_us_per_token / 1e6
        return dataclasses.replace(
            gen, prompt_tokens=tokens, cached_tokens=cached, prefill_s=prefill_s
        )

    def _unknown_model(self, body: object) -> bytes | None:
        """vLLM's 404 for a model it does not serve (none named: the served one); else None."""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model or model == self.settings.model:
            return None
        if self.adapter_slots is not None and model in self.behaviour.lora_adapters:
            return None
        return vllm_error_body(
            f"The model `{model}` does not exist. Valid aliases: {self.settings.model}.",
            "NotFoundError",
            404,
            "model",
        )

    async def _refuse(self, writer: ResponseWriter, path: str, exc: BadGenerationRequest) -> None:
        """A 400 in the engine's error shape for a request it cannot serve."""
        if self.settings.engine != "vllm" or path == "/v1/messages":
            await _bad_request(writer, str(exc), path)
            return
        type_ = "BadRequestError" if exc.refused else "Bad Request"
        await writer.respond(400, JSON_HEADERS, vllm_error_body(str(exc), type_, 400, exc.param))

    def _rank(self, rank_text: str | None) -> int | None:
        """The DP rank a request runs on: its header, else 0; None when the header is bad."""
        if rank_text is None:
            return 0
        try:
            rank = int(rank_text)
        except ValueError:
            return None
        return rank if 0 <= rank < self.settings.dp_size else None

    def _request_id(self, api: Api) -> str:
        self._next_id += 1
        return f"{REQUEST_ID_PREFIX[api]}{self._next_id}"

    async def _unary(self, writer: ResponseWriter, gen: Generation, load: RankLoad) -> None:
        behaviour = self.behaviour
        delay_ms = (
            behaviour.ttft_ms
            + gen.prefill_s * 1000
            + behaviour.token_latency_ms * max(0, gen.tokens - 1)
        )
        if delay_ms > 0:
            await trio.sleep(delay_ms / 1000)
        body = render_unary(
            gen,
            self._request_id(gen.api),
            int(time.time()),  # wall-clock: OpenAI `created` names a calendar second
            vllm=self._vllm,
        )
        load.generation_tokens += gen.completion_tokens
        await writer.respond(200, JSON_HEADERS, body)

    async def _stream(self, writer: ResponseWriter, gen: Generation, load: RankLoad) -> None:
        """Stream the events, sleeping between tokens; events between two sleeps go out in
        one write. Cancellation: stops at once; nothing is left behind."""
        frames = stream_frames(
            gen,
            self._request_id(gen.api),
            int(time.time()),  # wall-clock: OpenAI `created` names a calendar second
            vllm=self._vllm,
        )
        await writer.start(200, SSE_HEADERS)
        pending: list[bytes] = []
        for item in paced_events(frames, self.behaviour, load):
            if isinstance(item, float):
                if pending:
                    await writer.write(b"".join(pending))
                    pending.clear()
                await trio.sleep(item)
            else:
                pending.append(item)
        if pending:
            await writer.write(b"".join(pending))
        await writer.finish()

    # -- scripted failures --------------------------------------------------------------

    async def _fail(
        self, request: Request, writer: ResponseWriter, streaming: bool, body: object = None
    ) -> None:
        """Serve the scripted failure in place of an answer. A break mid-answer cuts the
        answer the request would have got (its prompt, length and token ids), or a default
        one for a body the engine would not serve."""
        behaviour = self.behaviour
        if behaviour.fail_mode is not FailMode.MIDSTREAM:
            await serve_failure(behaviour, request, writer, streaming)
            return
        api = GENERATION_PATHS[request.path]
        try:
            gen = parse_request(api, body, behaviour.tokens, self.settings.model)
        except BadGenerationRequest:
            gen = Generation(
                api=api,
                model=self.settings.model,
                stream=streaming,
                tokens=behaviour.tokens,
                explicit_limit=False,
                n=1,
                prompt_tokens=0,
                include_usage=False,
            )
        request_id, created = self._request_id(gen.api), int(time.time())  # wall-clock: `created`
        if streaming:
            frames = stream_frames(gen, request_id, created, vllm=self._vllm)
            events = paced_events(frames, behaviour, RankLoad())
            await break_stream(request, writer, events, behaviour.fail_after_chunks)
        else:
            body_bytes = render_unary(gen, request_id, created, vllm=self._vllm)
            await break_unary(request, writer, body_bytes)

    # -- engine info --------------------------------------------------------------------

    async def _health(self, request: Request, writer: ResponseWriter) -> None:
        status = 200 if self.ready(trio.current_time()) else 503
        # vLLM answers an empty body with no content type; SGLang's is text.
        await writer.respond(status, () if self._vllm else TEXT_HEADERS, b"")

    async def _models(self, request: Request, writer: ResponseWriter) -> None:
        if self.adapter_slots is None:
            await writer.respond(200, JSON_HEADERS, self._models_body)
            return
        listing = info.models(self.settings)
        listing["data"] += model_cards(
            self.behaviour.lora_adapters, self.settings.model, self.adapter_roots, 0
        )
        body = _vllm_models(listing, self.settings.max_model_len)
        await _respond_json(writer, 200, body)

    async def _load_adapter(self, request: Request, writer: ResponseWriter) -> None:
        """vLLM's `POST /v1/load_lora_adapter`: `lora_name` and `lora_path` required; an
        adapter loaded already is refused unless `load_inplace`; answers a text line."""
        body = _json_object(request.body)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            await self._lora_refusal(
                writer,
                400,
                "InvalidUserInput",
                "Both 'lora_name' and 'lora_path' must be provided.",
            )
            return
        held = self.behaviour.lora_adapters
        if name == self.settings.model:
            await self._lora_refusal(
                writer,
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' conflicts with a served base model.",
            )
            return
        if name in held and body.get("load_inplace") is not True:
            await self._lora_refusal(
                writer,
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
            return
        self.adapter_roots[name] = path
        if name not in held:
            self.behaviour.lora_adapters = (*held, name)
        await writer.respond(
            200, TEXT_HEADERS, f"Success: LoRA adapter '{name}' added successfully.".encode()
        )

    async def _unload_adapter(self, request: Request, writer: ResponseWriter) -> None:
        """vLLM's `POST /v1/unload_lora_adapter`: 404 for an adapter it does not hold."""
        name = _json_object(request.body).get("lora_name")
        if not isinstance(name, str) or not name:
            await self._lora_refusal(
                writer,
                400,
                "InvalidUserInput",
                "'lora_name' needs to be provided to unload a LoRA adapter.",
            )
            return
        held = self.behaviour.lora_adapters
        if name not in held:
            await self._lora_refusal(
                writer, 404, "NotFoundError", f"The lora adapter '{name}' cannot be found."
            )
            return
        self.behaviour.lora_adapters = tuple(a for a in held if a != name)
        self.adapter_roots.pop(name, None)
        await writer.respond(
            200, TEXT_HEADERS, f"Success: LoRA adapter '{name}' removed successfully.".encode()
        )

    async def _lora_refusal(
        self, writer: ResponseWriter, status: int, type_: str, message: str
    ) -> None:
        await writer.respond(status, JSON_HEADERS, vllm_error_body(message, type_, status, None))

    async def _model_info(self, request: Request, writer: ResponseWriter) -> None:
        await writer.respond(200, JSON_HEADERS, self._model_info_body)

    async def _server_info(self, request: Request, writer: ResponseWriter) -> None:
        await _respond_json(
            writer,
            200,
            info.server_info(self.settings, self.port, self.gauge_loads(), self.load_port_base),
        )

    async def _version(self, request: Request, writer: ResponseWriter) -> None:
        await _respond_json(writer, 200, info.version())

    async def _kv_event_sources(self, request: Request, writer: ResponseWriter) -> None:
        await _respond_json(writer, 200, info.kv_event_sources(self.settings, self.kv_endpoints))

    async def _loads(self, request: Request, writer: ResponseWriter) -> None:
        await _respond_json(writer, 200, info.loads(self.settings, self.gauge_loads()))

    async def _server_load(self, request: Request, writer: ResponseWriter) -> None:
        """vLLM's `/load`: the requests its API server holds, counted as they arrive (not
        stepped like the gauges); 0 whatever it holds without the tracking flag."""
        held = 0
        if self.settings.enable_server_load_tracking:
            held = sum(running + queued for running, queued in self._live_counts())
        await _respond_json(writer, 200, {"server_load": held})

    async def _legacy_load(self, request: Request, writer: ResponseWriter) -> None:
        await _respond_json(writer, 200, info.legacy_load(self.gauge_loads()))

    async def _flush_cache(self, request: Request, writer: ResponseWriter) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        await writer.respond(200, TEXT_HEADERS, b"Cache flushed.\n")

    async def _metrics(self, request: Request, writer: ResponseWriter) -> None:
        settings = self.settings
        slots = self.adapter_slots
        text = render_metrics(
            settings.engine,
            settings.role,
            settings.model,
            self.gauge_loads(),
            info.capacity(settings),
            # wall-clock: vLLM's gauge holds the epoch time a series was last set
            None if slots is None else (slots.max_loras, slots.lora_info_series(time.time())),
        )
        await writer.respond(200, METRICS_HEADERS, text)

    # -- debug --------------------------------------------------------------------------

    async def _debug_routing(self, request: Request, writer: ResponseWriter) -> None:
        await _respond_json(writer, 200, self.routing.to_json())

    async def _debug_reset(self, request: Request, writer: ResponseWriter) -> None:
        self.routing.reset()
        await _respond_json(writer, 200, self.routing.to_json())

    async def _debug_behaviour(self, request: Request, writer: ResponseWriter) -> None:
        if request.method in ("POST", "PUT"):
            try:
                changes = orjson.loads(request.body)
            except orjson.JSONDecodeError:
                await _bad_request(writer, "the behaviour update is not valid JSON")
                return
            try:
                self.behaviour.update(changes)
            except InvalidBehaviour as exc:
                await _bad_request(writer, str(exc))
                return
        await _respond_json(writer, 200, self.behaviour.to_json())


class _ReportUrl:
    """Turns the server's "bound to port P" into the worker's URL for our own caller."""

    def __init__(self, worker: FakeWorker, task_status: trio.TaskStatus[str]) -> None:
        self._worker = worker
        self._task_status = task_status

    def started(self, value: int | None = None) -> None:
        assert value is not None, "serve_http reports its port"
        self._worker.port = value
        self._task_status.started(self._worker.url)


async def serve_fake_worker(
    settings: FakeWorkerSettings,
    *,
    worker: FakeWorker | None = None,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake worker until cancelled, or until `shutdown` is set and in-flight requests
    end (within `settings.shutdown_grace_s`).

    Reports the bound URL (`http://host:port`) through `task_status`; `worker.port` holds
    the bound port from then on. A port that cannot be bound raises OSError, unwrapped,
    before that. Cancellation: every connection closes at once.
    """
    if worker is None:
        worker = FakeWorker(settings)
    server_settings = ServerSettings(
        host=settings.host, port=settings.port, shutdown_grace_s=settings.shutdown_grace_s
    )
    serve = partial(
        serve_http,
        worker.handler,
        server_settings,
        shutdown=shutdown,
        answer_refusal=answer_refusal,
        task_status=_ReportUrl(worker, task_status),
    )
    if settings.gauge_step_ms <= 0:
        await serve()
        return
    # The stepping gauges beside the server (a bind failure then comes in a group).
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.step_gauges)
        await serve()
        nursery.cancel_scope.cancel()

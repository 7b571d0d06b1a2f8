"""One attempt at a `grpc://` worker: tokenize, `Generate` over gRPC, and the token stream
turned back into the client's OpenAI answer.

The attempt loop, the breaker and failover are the HTTP path's (`router.pipeline.attempt`
calls `GrpcDispatch.exchange` where it would open an HTTP request); this module is the
edge where gRPC's outcomes become the same vocabulary (`AttemptFailed`), by one table
(`STATUS_ANSWERS`):

- before the first token reached the client, a connection that cannot be made or
  breaks, UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL and any status not listed are
  faults that fail over and count for the breaker; RESOURCE_EXHAUSTED is a 429 that
  fails over without counting; INVALID_ARGUMENT (and the other refusals of the request)
  is the client's answer at once, its message verbatim, no verdict against the worker;
- after it, a broken call ends the stream with the API's error event.

The text is made here from the ids (`router.prompts.detokenize.StreamedText`, one per
choice, primed with the prompt as vLLM primes its detokenizer), so multi-byte characters,
leading spaces, stop strings and what they hold back come out as the engine's own
detokenizer gives them; the answer's bytes are the route's API's
(`router.pipeline.grpc_answers`), streamed as the ids come, or assembled from the
engine's `complete` per choice.

A generation this side stops reading (the client left, the request was cancelled, the
stream stalled) is aborted at the engine: its stream is reset and `Abort` names it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson
import trio

from router.api.error_shapes import stream_error_event
from router.api.errors import BadRequest, RouterOverloaded
from router.api.routes import Dialect
from router.engines.grpc_service import (
    GENERATE,
    GrpcFactsUnavailable,
    GrpcMessagesMissing,
    abort,
    messages,
    model_info,
)
from router.http import clock
from router.http.grpc import (
    GrpcBroken,
    GrpcCall,
    GrpcConnectError,
    GrpcError,
    GrpcPool,
    GrpcStatusError,
    StatusCode,
)
from router.http.server.messages import ResponseWriter
from router.http.upstream.exceptions import LocalShortage
from router.pipeline.dispatch import Answer, AttemptFailed, Timeouts
from router.pipeline.grpc_answers import AnswerShapes, Finished, TokenLogprob, Usage, shapes_for
from router.pipeline.grpc_request import (
    GrpcGeneration,
    build_generate,
    completions_prompt,
    generate_prompt,
)
from router.pipeline.resolve import GenerationRequest
from router.prompts.chat_request import NotRendered
from router.prompts.chat_template import TemplateFailed
from router.prompts.detokenize import StreamedText
from router.prompts.tokenizer import COMPLETION_CONTEXT, HfTokenizer, TextTokenizer

log: Final = logging.getLogger("router.dispatch")

ABORT_TIMEOUT_S: Final = 1.0
"""How long a cancelled request's cleanup waits for the engine to take its `Abort`."""

STREAM_HEADERS: Final[list[tuple[bytes, bytes]]] = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
JSON_HEADERS: Final[list[tuple[bytes, bytes]]] = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True)
class StatusAnswer:
    status: int
    """The HTTP status the client gets when this is the last answer."""
    error_type: str
    fault: bool
    retryable: bool


STATUS_ANSWERS: Final[Mapping[StatusCode, StatusAnswer]] = {
    StatusCode.INVALID_ARGUMENT: StatusAnswer(400, "BadRequestError", False, False),
    StatusCode.OUT_OF_RANGE: StatusAnswer(400, "BadRequestError", False, False),
    StatusCode.FAILED_PRECONDITION: StatusAnswer(400, "BadRequestError", False, False),
    StatusCode.NOT_FOUND: StatusAnswer(404, "NotFoundError", False, False),
    StatusCode.UNAUTHENTICATED: StatusAnswer(401, "AuthenticationError", False, False),
    StatusCode.PERMISSION_DENIED: StatusAnswer(403, "PermissionDeniedError", False, False),
    StatusCode.RESOURCE_EXHAUSTED: StatusAnswer(429, "RateLimitError", False, True),
    StatusCode.UNAVAILABLE: StatusAnswer(503, "ServiceUnavailableError", True, True),
    StatusCode.DEADLINE_EXCEEDED: StatusAnswer(504, "TimeoutError", True, True),
    StatusCode.UNIMPLEMENTED: StatusAnswer(501, "NotImplementedError", True, True),
}
"""How a gRPC status before the first token is judged; any other is a 500 fault."""
OTHER_STATUS: Final = StatusAnswer(500, "InternalServerError", True, True)


def status_failure(url: str, error: GrpcStatusError) -> AttemptFailed:
    """The attempt's failure for a call that ended with `error` before the first token."""
    verdict = STATUS_ANSWERS.get(error.code, OTHER_STATUS)
    body = orjson.dumps(
        {
            "error": {
                "message": error.message or error.code.name,
                "type": verdict.error_type,
                "param": None,
                "code": verdict.status,
            }
        }
    )
    return AttemptFailed(
        f"grpc_{error.code.name.lower()}",
        f"{url} ended the call {error.code.name}: {error.message}",
        fault=verdict.fault,
        answer=Answer(verdict.status, list(JSON_HEADERS), body),
        retryable=verdict.retryable,
    )


def call_failure(url: str, error: GrpcError | LocalShortage) -> AttemptFailed:
    """The attempt's failure for anything else that ended a call before the first token."""
    if isinstance(error, LocalShortage):
        raise RouterOverloaded(str(error), error.kind) from None
    if isinstance(error, GrpcStatusError):
        return status_failure(url, error)
    if isinstance(error, GrpcConnectError):
        return AttemptFailed("connect_error", str(error), fault=True)
    if isinstance(error, GrpcBroken):
        if error.unprocessed:
            # The worker said it never began the call (GOAWAY, REFUSED_STREAM): going
            # away is no fault, and the call goes elsewhere exactly once.
            return AttemptFailed("worker_went_away", f"{url}: {error}", fault=False)
        return AttemptFailed("transport_error", f"{url} broke the call: {error}", fault=True)
    return AttemptFailed("invalid_body", f"{url} sent what gRPC cannot carry: {error}", fault=True)


@dataclass(frozen=True, slots=True)
class EngineText:
    """What the router needs of a gRPC worker's model to talk tokens with it."""

    tokenizer: TextTokenizer
    eos_ids: frozenset[int]


class GrpcEngines:
    """Each gRPC worker's tokenizer and end-of-sequence ids: `GetModelInfo` once per
    worker, the tokenizer loaded once per directory (in a thread: a large model's takes
    a while), both kept until the worker leaves (`forget`). A directory that cannot be
    loaded here is not tried again for `retry_s`: requests meanwhile go elsewhere at
    once, without a thread each."""

    def __init__(
        self,
        pool: GrpcPool,
        timeout_s: float,
        load: Callable[[str], TextTokenizer] = HfTokenizer,
        retry_s: float = 10.0,
    ) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._load = load
        self._retry_s = retry_s
        self._engines: dict[str, EngineText] = {}
        self._tokenizers: dict[str, TextTokenizer] = {}
        self._unloadable: dict[str, tuple[float, str]] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def get(self, url: str) -> EngineText:
        """The worker's `EngineText`; AttemptFailed when it cannot be had (a worker that
        does not answer is a fault; a tokenizer this process cannot read is not)."""
        known = self._engines.get(url)
        if known is not None:
            return known
        lock = self._locks.setdefault(url, trio.Lock())
        async with lock:
            known = self._engines.get(url)
            if known is not None:
                return known
            try:
                info = await model_info(self._pool, url, self._timeout_s)
            except GrpcFactsUnavailable as unavailable:
                raise AttemptFailed("model_info", str(unavailable), fault=True) from None
            except GrpcMessagesMissing as missing:
                raise AttemptFailed("no_grpc_messages", str(missing), fault=False) from None
            path = info.tokenizer_path
            tokenizer = self._tokenizers.get(path)
            if tokenizer is None:
                now = clock.now()
                failed = self._unloadable.get(path)
                if failed is None or now - failed[0] >= self._retry_s:
                    try:
                        tokenizer = await trio.to_thread.run_sync(self._load, path)
                    except (ValueError, OSError) as unreadable:
                        failed = self._unloadable[path] = (now, str(unreadable))
                if tokenizer is None:
                    assert failed is not None
                    raise AttemptFailed(
                        "no_tokenizer",
                        f"{url}: the tokenizer it names ({path!r}) cannot be loaded here: "
                        f"{failed[1]}",
                        fault=False,
                    )
                self._unloadable.pop(path, None)
                self._tokenizers[path] = tokenizer
            engine = EngineText(tokenizer, frozenset(info.eos_token_ids))
            self._engines[url] = engine
            return engine

    def forget(self, url: str) -> None:
        self._engines.pop(url, None)
        self._locks.pop(url, None)


def prompt_ids(generation: GenerationRequest, tokenizer: TextTokenizer) -> list[int]:
    """The prompt's token ids as vLLM computes them; BadRequest naming what the router
    does not render."""
    try:
        if generation.route in ("chat", "messages", "responses"):
            return tokenizer.chat_tokens(generation.body, anthropic=generation.route == "messages")
        if generation.route == "generate":
            prompt = generate_prompt(generation.body)
        else:
            prompt = completions_prompt(generation.body)
        return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    except NotRendered as unrendered:
        raise BadRequest(
            f"over gRPC the router renders the prompt itself, and not this: {unrendered}"
        ) from None
    except TemplateFailed as failed_template:
        raise BadRequest(f"the chat template failed for this request: {failed_template}") from None


class Choices:
    """The text of every choice of one generation, made from the ids as they come, and
    the logprobs of its tokens when the request asked for them."""

    __slots__ = ("_built", "_logprobs", "_sampled", "_tokenizer", "finished", "texts")

    def __init__(self, built: GrpcGeneration, tokenizer: TextTokenizer) -> None:
        self._built = built
        self._tokenizer = tokenizer
        self.texts: dict[int, StreamedText] = {}
        self.finished: dict[int, Finished] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._sampled: dict[int, deque[int]] = {}

    def add_logprobs(self, index: int, proto: Any) -> None:
        """Keep an `OutputLogProbs` message's entries for choice `index` (nothing when
        the request asked for none)."""
        if self._built.logprobs is None:
            return
        pending = self._logprobs.setdefault(index, [])
        # A token that is part of a character takes its text from the ids sampled before
        # it; only the last few can matter.
        sampled = self._sampled.setdefault(index, deque(maxlen=COMPLETION_CONTEXT))
        text = self._tokenizer.token_text
        tops = proto.top_logprobs
        for position, (token_id, logprob) in enumerate(
            zip(proto.token_ids, proto.token_logprobs, strict=False)
        ):
            context = tuple(sampled)
            top: tuple[tuple[str, float], ...] = ()
            if position < len(tops):
                alternatives = tops[position]
                top = tuple(
                    (text(other, context), value)
                    for other, value in zip(
                        alternatives.token_ids, alternatives.values, strict=False
                    )
                )
            pending.append(TokenLogprob(text(token_id, context), logprob, top))
            sampled.append(token_id)

    def take_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """Choice `index`'s entries not given out yet; None when none were asked for."""
        if self._built.logprobs is None:
            return None
        return self._logprobs.pop(index, [])

    def text(self, index: int) -> StreamedText:
        text = self.texts.get(index)
        if text is None:
            built = self._built
            step = self._tokenizer.decode_stream(
                built.prompt_ids, skip_special_tokens=built.skip_special_tokens
            )
            text = self.texts[index] = StreamedText(
                step,
                stops=built.stops,
                include_stop=built.include_stop,
                min_tokens=built.min_tokens,
            )
        return text

    def push(self, index: int, ids: Any) -> StreamedText:
        text = self.text(index)
        stop_ids = self._built.stop_ids
        for token_id in ids:
            if text.stopped_by is not None:
                text.tokens += 1  # the engine's count goes on; the text is over
            elif token_id in stop_ids:
                text.push_stop_token(token_id)
            else:
                text.push(token_id)
        return text

    @property
    def completion_tokens(self) -> int:
        return sum(text.tokens for text in self.texts.values())


def finish_of(complete: Any, text: StreamedText) -> tuple[str, Any]:
    """A choice's finish reason and stop reason: the engine's, unless the text here ended
    at a stop string first (then `stop` and that string, as the engine reports it)."""
    if text.stopped_by is not None:
        return "stop", text.stopped_by
    return complete.finish_reason, stop_reason_of(complete)


def stop_reason_of(complete: Any) -> Any:
    kind = complete.WhichOneof("matched_stop")
    if kind == "matched_stop_str":
        return complete.matched_stop_str
    if kind == "matched_token_id":
        return complete.matched_token_id
    return None


class GrpcDispatch:
    """Runs one attempt's exchange with a gRPC worker (see the module's docstring)."""

    def __init__(self, pool: GrpcPool, engines: GrpcEngines, timeouts: Timeouts) -> None:
        self.pool = pool
        self.engines = engines
        self.timeouts = timeouts

    async def exchange(
        self,
        url: str,
        generation: GenerationRequest,
        request_id: str,
        rank: int | None,
        metadata: list[tuple[bytes, bytes]],
        writer: ResponseWriter,
        begin: Callable[[int], Awaitable[None]],
        worker_header: tuple[bytes, bytes],
        dialect: Dialect,
    ) -> int:
        """Serve `generation` from the worker at `url`; the status the client got.

        `begin(status)` is awaited once, at the point of no return (the lease's verdict
        and commit). Raises AttemptFailed while nothing reached the client, BadRequest
        for a prompt the router does not render. Cancellation: the call is reset and the
        engine told to abort the generation.
        """
        engine = await self.engines.get(url)
        ids = prompt_ids(generation, engine.tokenizer)
        built = build_generate(messages(), generation, ids, request_id, engine.eos_ids, rank)
        shapes = shapes_for(generation.route, request_id, generation.model)
        choices = Choices(built, engine.tokenizer)
        done = False
        try:
            async with self.pool.call(
                url, GENERATE, built.request, metadata, connect_timeout_s=self.timeouts.connect_s
            ) as call:
                if generation.stream:
                    status = await self._stream(
                        url, call, built, choices, shapes, writer, begin, worker_header, dialect
                    )
                else:
                    status = await self._unary(
                        url, call, choices, shapes, writer, begin, worker_header
                    )
                done = True
                return status
        except GrpcError as grpc_error:
            # A status is the engine's own end of the call: nothing left to abort.
            done = isinstance(grpc_error, GrpcStatusError)
            raise call_failure(url, grpc_error) from None
        except LocalShortage as shortage:
            raise call_failure(url, shortage) from None
        finally:
            if not done:
                await self._abort(url, built.request_id)

    async def _abort(self, url: str, request_id: str) -> None:
        """Tell the engine to stop a generation this side no longer reads (shielded: it
        runs while the request is being cancelled)."""
        with trio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            await abort(self.pool, url, [request_id], ABORT_TIMEOUT_S)

    async def _first(self, url: str, call: GrpcCall) -> Any:
        """The first message, within the first-byte deadline; AttemptFailed otherwise."""
        timeout_s = self.timeouts.first_byte_s
        with trio.move_on_after(timeout_s) as waited:
            raw = await call.receive_message()
        if waited.cancelled_caught:
            raise AttemptFailed(
                "first_byte_timeout", f"{url} sent no token within {timeout_s:g}s", fault=True
            )
        if raw is None:
            raise AttemptFailed(
                "empty_stream", f"{url} ended the call without an answer", fault=True
            )
        return _parse(url, raw)

    async def _stream(
        self,
        url: str,
        call: GrpcCall,
        built: GrpcGeneration,
        choices: Choices,
        shapes: AnswerShapes,
        writer: ResponseWriter,
        begin: Callable[[int], Awaitable[None]],
        worker_header: tuple[bytes, bytes],
        dialect: Dialect,
    ) -> int:
        message = await self._first(url, call)
        await begin(200)
        # The head leaves with the first events, in one send.
        head: list[tuple[bytes, bytes]] | None = [*STREAM_HEADERS, worker_header]
        first = message.chunk if message.WhichOneof("response") == "chunk" else message.complete
        out = shapes.opening(built.n, first.prompt_tokens)
        prompt_tokens = cached_tokens = 0
        idle_s = self.timeouts.stream_idle_s
        error: bytes | None = None
        with trio.CancelScope() as idle:
            while True:
                kind = message.WhichOneof("response")
                if kind == "chunk":
                    chunk = message.chunk
                    prompt_tokens, cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
                    text = choices.push(chunk.index, chunk.token_ids)
                    if chunk.HasField("output_logprobs"):
                        choices.add_logprobs(chunk.index, chunk.output_logprobs)
                    piece = text.take()
                    # With logprobs, a chunk per step even while its text is held back,
                    # as vLLM's servers stream them (completions' `text_offset` counts
                    # from the text given out before each chunk).
                    entries = choices.take_logprobs(chunk.index)
                    if piece or entries:
                        out += shapes.delta(chunk.index, piece, entries)
                elif kind == "complete":
                    complete = message.complete
                    prompt_tokens = complete.prompt_tokens or prompt_tokens
                    cached_tokens = complete.cached_tokens or cached_tokens
                    text = choices.text(complete.index)
                    if complete.finish_reason in ("abort", "error"):
                        error = stream_error_event(
                            f"worker {url} ended the generation ({complete.finish_reason})",
                            "stream_interrupted",
                            dialect,
                        )
                        break
                    finish, stop_reason = finish_of(complete, text)
                    done = Finished(
                        complete.index,
                        text.take(finished=True),
                        finish,
                        stop_reason,
                        choices.take_logprobs(complete.index),
                    )
                    out += shapes.finish(done)
                    choices.finished[complete.index] = done
                if head is not None:
                    await writer.start(200, head, out)
                    head, out = None, b""
                elif out:
                    await writer.write(out)
                    out = b""
                idle.deadline = clock.now() + idle_s
                try:
                    raw = await call.receive_message()
                except GrpcError as grpc_error:
                    error = stream_error_event(
                        f"worker {url} broke the stream: {grpc_error}",
                        "stream_interrupted",
                        dialect,
                    )
                    break
                if raw is None:
                    break
                try:
                    message = _parse(url, raw)
                except AttemptFailed as attempt_failed:
                    error = stream_error_event(attempt_failed.detail, "stream_interrupted", dialect)
                    break
        if idle.cancelled_caught:
            error = stream_error_event(
                f"worker {url} stalled for {idle_s:g}s mid-stream", "stream_idle_timeout", dialect
            )
        elif error is None and len(choices.finished) < built.n:
            error = stream_error_event(
                f"worker {url} ended the stream before every choice finished",
                "stream_interrupted",
                dialect,
            )
        if head is not None:  # broken before the first message was written
            await writer.start(200, head)
        if error is not None:
            if idle.cancelled_caught:
                await self._abort(url, built.request_id)
            await writer.finish(out + error)
            return 200
        usage = Usage(prompt_tokens, choices.completion_tokens, cached_tokens)
        await writer.finish(out + shapes.closing(usage, built.include_usage))
        return 200

    async def _unary(
        self,
        url: str,
        call: GrpcCall,
        choices: Choices,
        shapes: AnswerShapes,
        writer: ResponseWriter,
        begin: Callable[[int], Awaitable[None]],
        worker_header: tuple[bytes, bytes],
    ) -> int:
        message = await self._first(url, call)
        prompt_tokens = cached_tokens = 0
        finished: list[Finished] = []
        idle_s = self.timeouts.stream_idle_s
        while message is not None:
            if message.WhichOneof("response") == "complete":
                complete = message.complete
                prompt_tokens, cached_tokens = complete.prompt_tokens, complete.cached_tokens
                if complete.finish_reason in ("abort", "error"):
                    raise AttemptFailed(
                        "generation_" + complete.finish_reason,
                        f"{url} ended the generation ({complete.finish_reason})",
                        fault=True,
                    )
                text = choices.push(complete.index, complete.output_ids)
                if complete.HasField("output_logprobs"):
                    choices.add_logprobs(complete.index, complete.output_logprobs)
                finish, stop_reason = finish_of(complete, text)
                finished.append(
                    Finished(
                        complete.index,
                        text.take(finished=True),
                        finish,
                        stop_reason,
                        choices.take_logprobs(complete.index),
                    )
                )
            with trio.move_on_after(idle_s) as waited:
                raw = await call.receive_message()
            if waited.cancelled_caught:
                raise AttemptFailed(
                    "body_timeout", f"{url} stalled for {idle_s:g}s mid-answer", fault=True
                )
            message = None if raw is None else _parse(url, raw)
        usage = Usage(prompt_tokens, choices.completion_tokens, cached_tokens)
        await begin(200)
        await writer.respond(200, [*JSON_HEADERS, worker_header], shapes.unary(finished, usage))
        return 200


def _parse(url: str, raw: bytes) -> Any:
    try:
        return messages().GenerateResponse.FromString(raw)
    except Exception:  # protobuf raises its own DecodeError
        raise AttemptFailed(
            "invalid_body", f"{url} answered a message that is not a GenerateResponse", fault=True
        ) from None

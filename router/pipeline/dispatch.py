"""Upstream calls for one attempt: headers out, the answer judged, SSE relayed as bytes.

This is the edge where pool and socket errors become `AttemptFailed` (retryable,
with or without a worker's answer) so the attempt loop sees one vocabulary; the router's
own shortages (`LocalShortage`) become `RouterOverloaded`, a 503 that blames no worker.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol

import orjson
import trio

from router.api.errors import RouterOverloaded, WorkerUnreachable
from router.http import clock
from router.http.server.messages import Headers, ResponseWriter
from router.http.upstream.connection import UpstreamConnectTimeout
from router.http.upstream.exceptions import (
    LocalShortage,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from router.http.upstream.pool import UpstreamAnswer, UpstreamRequests
from router.pipeline.relay import EventCutter
from router.pipeline.stall_watch import StallWatch
from router.pipeline.stream_capture import GarbledEvent

log: Final = logging.getLogger("router.dispatch")

# Request headers a worker needs from the client; everything else stays at the router.
FORWARDED_REQUEST_HEADERS: Final = frozenset(
    {b"content-type", b"authorization", b"x-request-id", b"traceparent", b"tracestate"}
)
# Response headers of a worker the client gets back.
RELAYED_RESPONSE_HEADERS: Final = frozenset({b"content-type", b"retry-after", b"x-request-id"})
RANK_HEADER: Final = b"x-data-parallel-rank"
WORKER_HEADER: Final = b"x-router-worker"


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    stream_idle_s: float


@dataclass(slots=True, init=False)
class Answer:
    """A worker's complete answer, read but not yet given to the client."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class AttemptFailed(Exception):
    """One attempt failed before any byte reached the client: another worker may be tried.

    `fault` says whether it counts against the worker's breaker (transport errors,
    timeouts, 5xx, unparseable unary bodies) or not (429: backpressure).
    `answer` is the worker's own answer when it gave one, returned as-is if attempts run out.
    `retryable=False` marks an answer every worker would repeat (a prefill's 4xx): the
    client gets it at once.
    """

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        fault: bool,
        answer: Answer | None = None,
        retryable: bool = True,
    ) -> None:
        super().__init__(detail)
        self.retryable = retryable
        self.reason = reason
        self.detail = detail
        self.fault = fault
        self.answer = answer


def unexpected_failure(url: str, exc: Exception) -> WorkerUnreachable:
    """A 502 naming the worker for an exception no upstream error explains (a bug of ours
    or a request the pool refused): the lease's owner releases it without a verdict."""
    log.error("request to %s failed unexpectedly", url, exc_info=exc)
    return WorkerUnreachable(f"the request to worker {url} failed: {type(exc).__name__}: {exc}")


def upstream_headers(
    request_headers: Sequence[tuple[bytes, bytes]],
    rank: int | None,
    credential: bytes | None = None,
) -> list[tuple[bytes, bytes]]:
    """What a worker gets: the forwarded client headers, the DP rank, and the router's own
    `Authorization` for the worker in place of the client's when it holds one."""
    if credential is None:
        headers = [(k, v) for k, v in request_headers if k in FORWARDED_REQUEST_HEADERS]
    else:
        headers = [
            (k, v)
            for k, v in request_headers
            if k in FORWARDED_REQUEST_HEADERS and k != b"authorization"
        ]
        headers.append((b"authorization", credential))
    if rank is not None:
        headers.append((RANK_HEADER, str(rank).encode()))
    return headers


def client_headers(worker_headers: Headers, worker_id: str) -> list[tuple[bytes, bytes]]:
    headers = [(k, v) for k, v in worker_headers if k in RELAYED_RESPONSE_HEADERS]
    headers.append((WORKER_HEADER, worker_id.encode()))
    return headers


def open_upstream_response(
    pool: UpstreamRequests,
    url: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    timeouts: Timeouts,
) -> UpstreamAttempt:
    """Send the request and wait for response headers, within the first-byte deadline.

    An async context manager giving the `UpstreamResponse`. A new connection must also be
    made within the connect deadline, inside the first-byte one: a worker that is not
    there is given up on long before a slow one would be.
    Cancellation: the upstream connection is closed, never returned to the pool.
    """
    return UpstreamAttempt(
        pool.request(
            url,
            "POST",
            path,
            headers,
            body,
            connect_timeout_s=timeouts.connect_s,
            head_deadline=clock.now() + timeouts.first_byte_s,
        ),
        url,
        timeouts,
    )


class UpstreamAttempt:
    """`open_upstream_response`'s context manager: the pool's, with errors translated.

    A plain class rather than a generator-based context manager: it is entered once per
    upstream request.
    """

    __slots__ = ("_request", "_timeouts", "_url")

    def __init__(
        self, request: AbstractAsyncContextManager[UpstreamAnswer], url: str, timeouts: Timeouts
    ) -> None:
        self._request = request
        self._url = url
        self._timeouts = timeouts

    async def __aenter__(self) -> UpstreamAnswer:
        url = self._url
        try:
            return await self._request.__aenter__()
        except UpstreamTimeout:
            raise AttemptFailed(
                "first_byte_timeout",
                f"{url} sent no response headers within {self._timeouts.first_byte_s:g}s",
                fault=True,
            ) from None
        except UpstreamConnectTimeout as timed_out:
            raise AttemptFailed("connect_timeout", str(timed_out), fault=True) from None
        except UpstreamConnectError as refused:
            # The pool's message already names the URL.
            raise AttemptFailed("connect_error", str(refused), fault=True) from None
        except UpstreamError as broke:
            raise AttemptFailed(
                "transport_error", f"{url} broke the connection: {broke}", fault=True
            ) from None
        except LocalShortage as shortage:
            # The router's own trouble: no verdict on the worker, no other worker tried (it
            # would meet the same shortage).
            raise RouterOverloaded(str(shortage), shortage.kind) from None
        except Exception as unexpected:
            raise unexpected_failure(url, unexpected) from unexpected

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._request.__aexit__(exc_type, exc, traceback)


async def read_answer(response: UpstreamAnswer, url: str, idle_s: float) -> Answer:
    """Read a whole upstream body, no chunk further apart than `idle_s`."""
    whole = response.take_whole_body()
    if whole is not None:
        # It came with the head (a typical unary answer): no wait, so no idle scope.
        return Answer(response.status, response.headers, whole)
    parts: list[bytes] = []
    # One scope whose deadline moves with each chunk: a scope per chunk costs more.
    with trio.CancelScope() as idle:
        try:
            while True:
                idle.deadline = clock.now() + idle_s
                chunk = await response.receive_some()
                if not chunk:
                    break
                parts.append(chunk)
        except UpstreamError as broke:
            raise AttemptFailed(
                "transport_error", f"{url} broke the connection mid-answer: {broke}", fault=True
            ) from None
        except Exception as unexpected:
            raise unexpected_failure(url, unexpected) from unexpected
    if idle.cancelled_caught:
        raise AttemptFailed("body_timeout", f"{url} stalled for {idle_s:g}s mid-answer", fault=True)
    return Answer(
        response.status, response.headers, parts[0] if len(parts) == 1 else b"".join(parts)
    )


def judge_answer(answer: Answer, url: str, *, expect_json: bool) -> Answer:
    """Retryable answers raise AttemptFailed; anything else is the client's answer.

    5xx and (for unary) a 200 that is not JSON are faults; 429 is retried but is
    backpressure, not a fault; other 4xx are the request's own fault and returned verbatim.
    """
    status = answer.status
    if status >= 500:
        raise AttemptFailed(
            f"status_{status}", f"{url} answered {status}", fault=True, answer=answer
        )
    if status == 429:
        raise AttemptFailed("status_429", f"{url} answered 429", fault=False, answer=answer)
    if expect_json and status == 200:
        try:
            orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            raise AttemptFailed(
                "invalid_body",
                f"{url} answered 200 with a body that is not JSON",
                fault=True,
                answer=answer,
            ) from None
    return answer


def adapter_missing(answer: Answer, url: str, adapter: str) -> AttemptFailed:
    """A worker's 404 for a LoRA adapter it was thought to hold: a routing miss, not the
    client's error (another worker holds it) nor the worker's fault (it serves, it only
    lacks that adapter now). Retried elsewhere; the breaker records nothing."""
    return AttemptFailed(
        "adapter_missing",
        f"{url} answered 404 for adapter {adapter!r}, which it was listed with",
        fault=False,
        answer=answer,
    )


async def first_stream_chunk(response: UpstreamAnswer, url: str, idle_s: float) -> bytes:
    """The first body bytes of a 200 stream; nothing has reached the client yet."""
    try:
        # The deadline is the pool's timer's: no cancel scope per stream.
        chunk = await response.receive_some(clock.now() + idle_s)
    except UpstreamTimeout:
        raise AttemptFailed(
            "first_byte_timeout", f"{url} sent no stream event within {idle_s:g}s", fault=True
        ) from None
    except UpstreamError as broke:
        raise AttemptFailed(
            "transport_error", f"{url} broke the stream before its first event: {broke}", fault=True
        ) from None
    except Exception as unexpected:
        raise unexpected_failure(url, unexpected) from unexpected
    if not chunk:
        raise AttemptFailed(
            "empty_stream", f"{url} ended a 200 stream without any event", fault=True
        )
    return chunk


def stream_error_event(message: str, code: str) -> bytes:
    payload = orjson.dumps({"error": {"message": message, "type": "upstream_error", "code": code}})
    return b"event: error\ndata: " + payload + b"\n\n"


class EventFilter(Protocol):
    """What `relay_stream` passes whole events through (a stream that may resume):
    the bytes the client gets for them."""

    @property
    def complete(self) -> bool:
        """The client's stream has its end; nothing more is read from the worker."""
        ...

    @property
    def max_event_bytes(self) -> int:
        """The largest event it must see whole (a prompt's ids ride on one event)."""
        ...

    def feed(self, events: bytes) -> bytes:
        """The client's bytes for whole `events`; GarbledEvent for one it cannot read."""
        ...


class StreamBroken(Exception):
    """A stream relayed through an event filter broke after its first bytes reached the
    client; nothing more was written (no error event, no end), so the caller decides how
    the client's stream goes on: resumed elsewhere, or ended with `error_event`."""

    def __init__(self, code: str, message: str, mid_event: bool) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.mid_event = mid_event
        """The client's bytes stop inside an event (a flush past the bound): a blank line
        must close it before anything else is written."""

    def error_event(self, build: Callable[[str, str], bytes]) -> bytes:
        """The bytes that end the client's stream with the route's error event."""
        event = build(self.message, self.code)
        return b"\n\n" + event if self.mid_event else event


async def relay_stream(
    response: UpstreamAnswer,
    first: bytes,
    writer: ResponseWriter,
    url: str,
    stalls: StallWatch,
    error_event: Callable[[str, str], bytes] = stream_error_event,
    events: EventFilter | None = None,
    head: Headers | None = None,
) -> str | None:
    """Relay SSE bytes as they arrive; returns the code of the error event the stream
    ended with (`stream_interrupted`, `stream_idle_timeout`), None when it ended whole.

    `head`: the answer's 200 headers when the client's answer has not started yet; they
    go out at once, in one send with the events of `first` (None: a stream already
    started, which this goes on with).

    Everything up to the last complete event of what arrived goes out at once (an event
    ends at LF LF, CRLF CRLF or CR CR: `EventCutter`); bytes of an unfinished event are
    held until it completes, or until more than 64 KiB are held. Events that arrived with
    the worker's end of the body leave in one send with the answer's end. When the worker
    breaks or stays silent for `stalls.idle_s` mid-stream, the complete events already
    received have gone out and the held remainder is dropped, so the stream ends with a
    well-formed error event (`error_event(message, code)`: the route's dialect) (after a
    blank line if a 64 KiB flush left the client inside an event). Time spent writing to
    the client does not count as the worker's silence. `ClientDisconnected` from the
    writer propagates (the caller's scope closes the upstream connection).

    With `events` (a stream that may resume: `router.pipeline.resume_request`), whole
    events go through `events.feed` and the client gets what it returns; the stream must
    reach its end marker (`events.complete`), after which nothing more is read. A break,
    a stall, an event the filter cannot read or an end before the marker raises
    `StreamBroken` with nothing written for it and the stream left open.
    """
    cutter = EventCutter() if events is None else EventCutter(events.max_event_bytes)
    chunk = first
    error: tuple[str, str] | None = None
    tail = b""  # what the worker's end of the body left to write, with the answer's end
    # A worker silent too long: `stalls` closes its connection, which ends the read in
    # progress (no deadline moved per event, no scope per stream: `router.pipeline.stall_watch`).
    watched = stalls.watch(response.abandon)
    now = clock.reader()
    try:
        while True:
            ready = cutter.feed(chunk)
            if events is None and response.body_ended():
                # The body's end came with these bytes: they and the end leave together.
                tail = ready + cutter.flush()
                break
            if ready and events is not None:
                try:
                    ready = events.feed(ready)
                except GarbledEvent as exc:
                    error = (f"worker {url} broke the stream: {exc}", "stream_interrupted")
                    break
            if ready or head is not None:
                watched.waiting_since = math.inf
                if head is not None:
                    await writer.start(200, head, ready)
                    head = None
                else:
                    await writer.write(ready)
                watched.waiting_since = now()
            if events is not None and events.complete:
                break
            try:
                chunk = await response.receive_some()
            except UpstreamError:
                error = (f"worker {url} broke the stream", "stream_interrupted")
                break
            if not chunk:
                watched.waiting_since = math.inf
                tail = cutter.flush()
                if events is not None:
                    try:
                        tail = events.feed(tail) if tail else b""
                    except GarbledEvent as exc:
                        tail = b""
                        error = (f"worker {url} broke the stream: {exc}", "stream_interrupted")
                        break
                    if not events.complete:
                        error = (f"worker {url} ended the stream early", "stream_interrupted")
                break
    finally:
        stalls.forget(watched)
    if watched.stalled:
        error = (f"worker {url} stalled for {stalls.idle_s:g}s mid-stream", "stream_idle_timeout")
    if head is not None:
        # Nothing went out yet (a stream that arrived whole, or broke at once): the answer
        # starts now, with what there is.
        await writer.start(200, head, tail)
        tail = b""
    if error is None:
        await writer.finish(tail)
        return None
    if tail:
        await writer.write(tail)
    message, code = error
    if events is not None:
        raise StreamBroken(code, message, cutter.mid_event)
    event = error_event(message, code)
    await writer.write(b"\n\n" + event if cutter.mid_event else event)
    await writer.finish()
    return error[1]

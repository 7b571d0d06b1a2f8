"""Requests to a plane, as a client would make them, and what came back.

Nothing here judges an answer; it records status, headers, body and how a stream ended,
so that `conformance.expect` can compare them with a case's expectations.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from conformance.connections import open_plane_client, watch_exchange
from conformance.model import GET_ROUTES, ROUTES, RawBody, RequestSpec

__all__ = ["Answer", "Progress", "open_plane_client", "send_many", "send_one"]

# The field a `raw.nested` body nests its lists under, and a `raw.size` body pads.
NESTED_FIELD = "x_nested"
PADDING_FIELD = "x_padding"


@dataclass(slots=True)
class Answer:
    """One request's outcome. `status` is None when no HTTP status arrived at all.
    `notes` says what the runner did beyond sending it once (a resend, and why)."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    transport_error: str | None = None
    notes: list[str] = field(default_factory=list)

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def error_field(self, name: str) -> str | None:
        """`error.<name>` of an OpenAI-shaped error body (or a bare string `error`)."""
        data = self.json()
        if not isinstance(data, dict):
            return None
        error = data.get("error")
        if isinstance(error, dict):
            value = error.get(name)
            return None if value is None else str(value)
        if isinstance(error, str) and name == "message":
            return error
        value = data.get(name)
        return None if value is None else str(value)

    def excerpt(self, limit: int = 160) -> str:
        if not self.body:
            return (
                "(empty body)"
                if self.transport_error is None
                else f"(empty body; {self.transport_error})"
            )
        text = self.body.decode("utf-8", "replace").replace("\n", "\\n")
        return text if len(text) <= limit else text[:limit] + "..."


@dataclass(slots=True)
class Progress:
    """How many of a send's requests have received the first bytes of their answer's body
    (for a stream: the worker is generating)."""

    started: int = 0
    _moved: trio.Event = field(default_factory=trio.Event)

    def mark(self) -> None:
        self.started += 1
        self._moved.set()
        self._moved = trio.Event()

    async def wait_for(self, count: int) -> None:
        while self.started < count:
            await self._moved.wait()


def default_body(route: str, model: str, stream: bool) -> dict[str, Any]:
    if route == "chat":
        return {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": stream,
        }
    if route == "completions":
        return {"model": model, "prompt": "hello", "max_tokens": 4, "stream": stream}
    if route == "responses":
        return {"model": model, "input": "hello", "max_output_tokens": 4, "stream": stream}
    if route == "messages":
        return {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": stream,
        }
    if route == "embeddings":
        return {"model": model, "input": "hello"}
    return {
        "model": model,
        "text": "hello",
        "sampling_params": {"max_new_tokens": 4},
        "stream": stream,
    }


def request_body(request: RequestSpec, default_model: str) -> dict[str, Any]:
    """The default body for the route, with the step's overrides (null removes a key)."""
    body = default_body(request.route, request.model or default_model, request.stream)
    for key, value in request.body.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def raw_bytes(raw: RawBody, request: RequestSpec, default_model: str) -> bytes:
    """The bytes a raw request sends: its text, or the default body grown deep or large."""
    if raw.text is not None:
        return raw.text.encode("utf-8")
    body = request_body(request, default_model)
    text = json.dumps(body, separators=(",", ":"))
    if raw.nested is not None:
        # Built as text: a nested Python list this deep would break json.dumps itself.
        return (
            text[:-1] + f',"{NESTED_FIELD}":' + "[" * raw.nested + "]" * raw.nested + "}"
        ).encode()
    assert raw.size is not None
    head = text[:-1] + f',"{PADDING_FIELD}":"'
    filler = max(0, raw.size - len(head) - 2)
    return (head + "a" * filler + '"}').encode()


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    request: RequestSpec,
    default_model: str,
    progress: Progress | None = None,
) -> Answer:
    """Make one request and read its answer to the end (a stream until it closes).

    A broken connection is recorded in `transport_error`, keeping whatever arrived. A
    request the plane cannot have processed (a reused connection it closed before a byte
    of the answer, see `conformance.connections`) is sent once more on a new connection,
    and `notes` says so. `progress` is marked once the answer's first body bytes arrive.
    Cancellation: the connection is closed.
    """
    url = base_url + ROUTES[request.route]
    headers = dict(request.headers)
    method = "GET" if request.route in GET_ROUTES else "POST"
    if method == "GET":
        content = b""
    elif request.raw is None:
        content = json.dumps(request_body(request, default_model)).encode()
        headers.setdefault("content-type", "application/json")
    else:
        content = raw_bytes(request.raw, request, default_model)
        headers["content-type"] = request.raw.content_type
    answer, resend = await _send(client, method, url, content, headers, request.timeout_s, progress)
    if resend:
        # A pool of its own, so that the second try cannot meet another stale connection.
        async with open_plane_client(httpx.Limits(max_keepalive_connections=0)) as fresh:
            answer, _ = await _send(
                fresh, method, url, content, headers, request.timeout_s, progress
            )
        answer.notes.append(
            f"resent once on a new connection: the plane closed a reused connection "
            f"before any byte of an answer ({resend})"
        )
    return answer


async def _send(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    content: bytes,
    headers: dict[str, str],
    timeout_s: float,
    progress: Progress | None,
) -> tuple[Answer, str | None]:
    """One try: the answer, and the error that makes a resend safe (None: keep it)."""
    answer = Answer(status=None)
    with watch_exchange() as exchange:
        try:
            with trio.fail_after(timeout_s):
                await _exchange(client, method, url, content, headers, answer, progress)
        except trio.TooSlowError:
            answer.transport_error = f"no complete answer within {timeout_s:g}s"
        except httpx.HTTPError as exc:
            answer.transport_error = f"{type(exc).__name__}: {exc}"
            if answer.status is None and exchange.unprocessed(exc):
                return answer, answer.transport_error
    return answer, None


async def _exchange(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    content: bytes,
    headers: dict[str, str],
    answer: Answer,
    progress: Progress | None,
) -> None:
    async with client.stream(method, url, content=content, headers=headers) as response:
        answer.status = response.status_code
        answer.headers = {k.lower(): v for k, v in response.headers.items()}
        chunks: list[bytes] = []
        unmarked = progress
        try:
            async for chunk in response.aiter_raw():
                if unmarked is not None and chunk:
                    unmarked.mark()
                    unmarked = None
                chunks.append(chunk)
        finally:
            answer.body = b"".join(chunks)


async def send_many(
    client: httpx.AsyncClient,
    base_url: str,
    request: RequestSpec,
    default_model: str,
    progress: Progress | None = None,
) -> list[Answer]:
    """`request.count` requests, at most `request.concurrency` in flight; answers in order."""
    answers: list[Answer | None] = [None] * request.count
    limiter = trio.CapacityLimiter(request.concurrency)

    async def one(index: int) -> None:
        async with limiter:
            answers[index] = await send_one(client, base_url, request, default_model, progress)

    if request.concurrency == 1:
        for index in range(request.count):
            await one(index)
    else:
        async with trio.open_nursery() as nursery:
            for index in range(request.count):
                nursery.start_soon(one, index)
    return [answer for answer in answers if answer is not None]


def sse_events(body: bytes) -> list[Mapping[str, str]]:
    """The events of an SSE body: each a mapping of `event` and `data` (lines joined)."""
    events: list[Mapping[str, str]] = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not block.strip():
            continue
        event: dict[str, str] = {}
        for raw in block.decode("utf-8", "replace").split("\n"):
            name, _, value = raw.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name in ("event", "data"):
                event[name] = event[name] + "\n" + value if name in event else value
        if event:
            events.append(event)
    return events


@dataclass(frozen=True, slots=True)
class StreamContent:
    """What a chat or completions stream said: its text (every choice's `delta.content` or
    `text`, joined), the counts of each usage event, and the distinct `id`s of its events."""

    text: str
    usages: tuple[Mapping[str, Any], ...]
    ids: frozenset[str]


def stream_content(answer: Answer) -> StreamContent:
    text: list[str] = []
    usages: list[Mapping[str, Any]] = []
    ids: set[str] = set()
    for event in sse_events(answer.body):
        if _is_error(event):
            continue
        try:
            chunk = json.loads(event.get("data", ""))
        except ValueError:
            continue
        if not isinstance(chunk, dict):
            continue
        if chunk.get("id") is not None:
            ids.add(str(chunk["id"]))
        if isinstance(chunk.get("usage"), dict):
            usages.append(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str):
                text.append(piece)
    return StreamContent("".join(text), tuple(usages), frozenset(ids))


# The last event of a whole stream in APIs that send no `[DONE]`: Anthropic Messages,
# OpenAI Responses.
FINAL_EVENTS = ("message_stop", "response.completed", "response.incomplete")


def stream_end(answer: Answer) -> str:
    """How a stream ended: `done` ([DONE] or an API's final event last), `error` (an error event last, as an
    `event: error` or a data payload with an `error` key) or `truncated` (neither)."""
    events = sse_events(answer.body)
    if not events:
        return "truncated"
    last = events[-1]
    if last.get("event") in FINAL_EVENTS:
        return "done"
    data = last.get("data", "")
    if data.strip() == "[DONE]":
        # A plane may report the error and still close the stream with [DONE].
        if len(events) > 1 and _is_error(events[-2]):
            return "error"
        return "done"
    return "error" if _is_error(last) else "truncated"


def error_shape(answer: Answer) -> str | None:
    """How the answer writes its error down: `anthropic` (`{"type": "error", "error":
    {"type", "message"}}`), `openai` (`{"error": {...}}`), or None (no error, or neither).
    The body of an error status; for a 200 stream, its last error event."""
    if answer.status is not None and answer.status >= 400:
        return _shape(answer.json())
    errors = [event for event in sse_events(answer.body) if _is_error(event)]
    if not errors:
        return None
    try:
        return _shape(json.loads(errors[-1].get("data", "")))
    except ValueError:
        return None


def _shape(data: Any) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return None
    error = data["error"]
    if (
        data.get("type") == "error"
        and isinstance(error.get("type"), str)
        and isinstance(error.get("message"), str)
    ):
        return "anthropic"
    return "openai" if isinstance(error.get("message"), str) else None


def _is_error(event: Mapping[str, str]) -> bool:
    if event.get("event") in ("error", "response.failed"):
        return True
    try:
        payload = json.loads(event.get("data", ""))
    except ValueError:
        return False
    return isinstance(payload, dict) and "error" in payload

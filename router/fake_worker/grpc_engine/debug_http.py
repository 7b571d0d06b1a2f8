"""The fake gRPC engine's side port: the HTTP fake's `/debug/*` endpoints, over HTTP/1.1.

A test or a conformance run reads and scripts a fake gRPC engine exactly as it does an
HTTP one: `GET /debug/routing` (what reached it), `POST /debug/reset`, `GET`/`POST
/debug/behaviour` (its live behaviour, the same JSON), and `GET /health` (200 while the
process serves; the engine's own health is its `HealthCheck` RPC).

With `--kv-events`, two scripted failures of the KV-event stream (`kv_events`), each
answering `/debug/routing`'s `kv_events` object; without it they are 400:

- `POST /debug/kv_events/data_loss`: every live `SubscribeKvEvents` call ends with
  DATA_LOSS now, as when the relay cannot keep a stream whole (`ended` says how many);
- `POST /debug/kv_events/skip` with `{"batches": N}` (N >= 1): the next batch is
  numbered N later, the skipped ones never sent, as when the relay loses batches.

One request per connection (the answer says `connection: close`), parsed by llhttp
(`httptools`): bodies up to 1 MiB and whole requests up to 1 MiB more (413 beyond), and a
connection that sends no whole request within 10 s is closed. asyncio, like the grpcio server beside it (`main` says why).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools
import orjson

from router.fake_worker.behaviour import InvalidBehaviour
from router.fake_worker.grpc_engine.service import FakeVllmEngine

MAX_BODY = 1024 * 1024
# Everything but the body (request line, headers) may take this much more.
MAX_REQUEST = 2 * MAX_BODY
READ_TIMEOUT_S = 10.0
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
}


class _Request:
    """What llhttp reports of one request; `done` once the message is complete."""

    def __init__(self) -> None:
        self.url = b""
        self.body = bytearray()
        self.too_large = False
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        if len(self.body) + len(body) > MAX_BODY:
            self.too_large = True
        else:
            self.body += body

    def on_message_complete(self) -> None:
        self.done = True


def answer(engine: FakeVllmEngine, method: str, path: str, body: bytes) -> tuple[int, Any]:
    """The status and JSON answer of one debug request."""
    routes: dict[str, tuple[frozenset[str], Callable[[], tuple[int, Any]]]] = {
        "/debug/routing": (frozenset({"GET"}), lambda: (200, engine.routing_json())),
        "/debug/reset": (frozenset({"POST"}), lambda: _reset(engine)),
        "/debug/behaviour": (frozenset({"GET", "POST"}), lambda: _behaviour(engine, method, body)),
        "/debug/kv_events/data_loss": (frozenset({"POST"}), lambda: _kv_data_loss(engine)),
        "/debug/kv_events/skip": (frozenset({"POST"}), lambda: _kv_skip(engine, body)),
        "/health": (frozenset({"GET"}), lambda: (200, {"serving": True})),
    }
    route = routes.get(path)
    if route is None:
        return 404, _error(f"no route for {path}")
    methods, serve = route
    if method not in methods:
        return 405, _error(f"{method} is not allowed on {path}")
    return serve()


def _reset(engine: FakeVllmEngine) -> tuple[int, Any]:
    engine.reset_counters()
    return 200, engine.routing_json()


def _behaviour(engine: FakeVllmEngine, method: str, body: bytes) -> tuple[int, Any]:
    if method == "POST":
        try:
            changes = orjson.loads(body)
        except orjson.JSONDecodeError:
            return 400, _error("the behaviour update is not valid JSON")
        try:
            engine.behaviour.update(changes)
        except InvalidBehaviour as exc:
            return 400, _error(str(exc))
    return 200, engine.behaviour.to_json()


def _kv_data_loss(engine: FakeVllmEngine) -> tuple[int, Any]:
    hub = engine.kv_events
    if hub is None:
        return _kv_events_off()
    ended = hub.lose_all()
    return 200, {**hub.statistics().to_json(), "ended": ended}


def _kv_skip(engine: FakeVllmEngine, body: bytes) -> tuple[int, Any]:
    hub = engine.kv_events
    if hub is None:
        return _kv_events_off()
    try:
        batches = orjson.loads(body).get("batches")
    except (orjson.JSONDecodeError, AttributeError):
        batches = None
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        return 400, _error('the skip is {"batches": N}, N a whole number >= 1')
    hub.skip(batches)
    return 200, hub.statistics().to_json()


def _kv_events_off() -> tuple[int, Any]:
    return 400, _error("KV events are off: start the fake with --kv-events")


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


async def serve_connection(
    engine: FakeVllmEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Read one request, answer it, close. A request llhttp rejects is a 400."""
    request = _Request()
    parser = httptools.HttpRequestParser(request)
    status: int
    payload: Any
    received = 0
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            while not request.done and not request.too_large:
                data = await reader.read(64 * 1024)
                if not data:
                    return
                received += len(data)
                if received > MAX_REQUEST:
                    request.too_large = True
                    break
                parser.feed_data(data)
    except TimeoutError:
        writer.transport.abort()
        return
    except httptools.HttpParserError as exc:
        status, payload = 400, _error(f"malformed request: {exc}")
    else:
        if request.too_large:
            status, payload = (
                413,
                _error(
                    f"the request is larger than {MAX_REQUEST} bytes or its body than {MAX_BODY}"
                ),
            )
        else:
            method = parser.get_method().decode("ascii", "replace")
            path = httptools.parse_url(request.url).path.decode("utf-8", "replace")
            status, payload = answer(engine, method, path, bytes(request.body))
    body = orjson.dumps(payload)
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii")
    try:
        writer.write(head + body)
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def start_debug_server(engine: FakeVllmEngine, host: str, port: int) -> asyncio.Server:
    """Listen on `host:port` (0: any free port); OSError when it cannot bind."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(engine, reader, writer)

    return await asyncio.start_server(serve, host, port)

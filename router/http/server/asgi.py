"""The ASGI adapter: the handler the native server runs, as an ASGI 3 application.

`AsgiAdapter` turns an ASGI HTTP scope and its body messages into a `Request`, and ASGI
send calls into a `ResponseWriter`, so `RouterApp.handle` runs unchanged under any ASGI
server. `serve_asgi` runs it under hypercorn's trio worker (`router serve --server
hypercorn`), for deployments that need HTTP/2 or TLS from the router itself; hypercorn is
an optional extra, imported only there. The native front stays the default: it costs less
per request (see docs/performance.md).

Under hypercorn the per-connection cap (`max_connections`) is not enforced; the other
limits map onto hypercorn's settings or are enforced here (the body limit).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any, cast

import trio

from router.http.server.exceptions import (
    AnswerRefusal,
    BodyTooLarge,
    HandlerFailed,
    Refusal,
    plain_refusal,
)
from router.http.server.listen import open_tcp_sockets
from router.http.server.messages import ClientDisconnected, Handler, Headers, Request
from router.http.server.settings import ServerSettings

__all__ = ["AsgiAdapter", "HypercornMissing", "serve_asgi"]

logger = logging.getLogger("router.http.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_NO_BODY_STATUSES = frozenset({204, 304})
_BACKLOG = 4096
_DEFAULT_SETTINGS = ServerSettings()


class HypercornMissing(RuntimeError):
    """`--server hypercorn` was asked for, but hypercorn is not installed."""


class AsgiAdapter:
    """An ASGI 3 application serving `handler`.

    HTTP requests are read whole (413 past `max_body_bytes`), then handled while a sibling
    task waits on `receive()`: `http.disconnect` cancels the handler, as end-of-stream does
    on the native front. Lifespan messages are answered at once (there is nothing to start:
    the router's services run in the nursery around the server). WebSocket is refused.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int = 8 * 1024 * 1024,
        answer_refusal: AnswerRefusal = plain_refusal,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.answer_refusal = answer_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)
        elif kind == "websocket":
            # Closing before accepting makes the server answer the handshake with 403.
            await send({"type": "websocket.close", "code": 1008})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request. Cancellation: the handler is cancelled with it."""
        request = await self._read_request(scope, receive, send)
        if request is None:
            return
        writer = _AsgiWriter(send, request)
        handler_scope = trio.CancelScope()
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, request, writer, handler_scope)
            try:
                with handler_scope:
                    await self.handler(request, writer)
            except Exception as exc:
                failure = exc
            nursery.cancel_scope.cancel()
        if request.client_gone or writer.aborted or isinstance(failure, ClientDisconnected):
            return
        if failure is not None or not writer.finished:
            outcome = "raised" if failure is not None else "gave no complete response"
            logger.error(
                "handler %s: %s %s", outcome, request.method, request.path, exc_info=failure
            )
        if not writer.started:
            status, headers, body = self.answer_refusal(
                HandlerFailed("internal error while handling the request")
            )
            await writer.respond(status, headers, body)

    async def _read_request(self, scope: Scope, receive: Receive, send: Send) -> Request | None:
        """The request with its whole body; None when it was refused (413) or the client
        left before sending all of it.
        """
        headers = [(bytes(name), bytes(value)) for name, value in scope["headers"]]
        limit = self.max_body_bytes
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _refuse(
                    send, self.answer_refusal, BodyTooLarge(f"request body exceeds {limit} bytes")
                )
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    await _refuse(
                        send,
                        self.answer_refusal,
                        BodyTooLarge(f"request body exceeds {limit} bytes"),
                    )
                    return None
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
        query = scope.get("query_string", b"")
        target = raw_path + b"?" + query if query else raw_path
        client = scope.get("client")
        return Request(
            method=scope["method"],
            target=target.decode("latin-1"),
            headers=headers,
            body=b"".join(chunks),
            client=(client[0], client[1]) if client else None,
        )


async def _watch_disconnect(
    receive: Receive, request: Request, writer: _AsgiWriter, handler_scope: trio.CancelScope
) -> None:
    """Cancel `handler_scope` on `http.disconnect`, unless the whole response went out."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not writer.finished:
                request.client_gone = True
                handler_scope.cancel()
            return


async def _lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; hypercorn under trio fails without the answers."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _refuse(send: Send, answer_refusal: AnswerRefusal, refusal: Refusal) -> None:
    status, headers, body = answer_refusal(refusal)
    head = [*headers, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _AsgiWriter:
    """The ASGI `ResponseWriter`: each call is one or two ASGI send messages.

    An ASGI server does not fail a send to a client that left (it drops the bytes and
    reports `http.disconnect` on `receive()`), so `write()` raises `ClientDisconnected` once
    the disconnect watcher saw it.
    """

    __slots__ = ("_request", "_send", "_started", "aborted", "finished")

    def __init__(self, send: Send, request: Request) -> None:
        self._send = send
        self._request = request
        self._started = False
        self.finished = False
        self.aborted = False

    @property
    def started(self) -> bool:
        return self._started

    async def abort(self, *, reset: bool = False) -> None:
        """Leave the answer unfinished; the server drops the connection when the handler
        returns. ASGI reaches no socket, so `reset` cannot make it an RST, and hypercorn
        answers 500 in place of a response that never started.
        """
        self.aborted = True
        await trio.lowlevel.checkpoint()

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Send a whole response with a Content-Length (none for 204/304)."""
        head = list(headers)
        if status not in _NO_BODY_STATUSES:
            head.append((b"content-length", b"%d" % len(body)))
        await self.start(status, head)
        self.finished = True
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """Send the status and headers (and `first`, a message of its own: ASGI has no
        head with body); without a content-length the server chunks the body."""
        if self._started:
            raise RuntimeError("the response was already started")
        self._check_client()
        self._started = True
        await self._send(
            {"type": "http.response.start", "status": status, "headers": list(headers)}
        )
        if first:
            await self.write(first)

    async def write(self, data: bytes) -> None:
        """Send one body chunk. Raises ClientDisconnected once the client is known gone."""
        if not self._started or self.finished:
            raise RuntimeError("write() needs start() first and no finish() yet")
        self._check_client()
        if data:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, last: bytes = b"") -> None:
        if not self._started or self.finished:
            raise RuntimeError("finish() needs start() first and no finish() yet")
        self._check_client()
        self.finished = True
        await self._send({"type": "http.response.body", "body": last, "more_body": False})

    def _check_client(self) -> None:
        if self._request.client_gone:
            raise ClientDisconnected("the client closed the connection")


async def serve_asgi(
    handler: Handler,
    settings: ServerSettings = _DEFAULT_SETTINGS,
    *,
    shutdown: trio.Event | None = None,
    answer_refusal: AnswerRefusal = plain_refusal,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `handler` under hypercorn (HTTP/1.1 and h2c) until cancelled or `shutdown`.

    Same contract as `serve_http`: reports the bound port through `task_status`; on
    `shutdown` stops accepting and gives in-flight requests `settings.shutdown_grace_s`.
    Raises HypercornMissing when hypercorn is not installed, OSError when the address
    cannot be bound, both before reporting.
    Cancellation: every connection is closed at once.
    """
    try:
        from hypercorn.config import Config
        from hypercorn.trio import serve
        from hypercorn.typing import ASGIFramework
    except ImportError as exc:
        raise HypercornMissing(
            "--server hypercorn needs hypercorn: pip install 'trio-router[asgi]'"
        ) from exc
    sockets = await open_tcp_sockets(settings.host, settings.port, reuse_port=settings.reuse_port)
    port: int = sockets[0].getsockname()[1]
    config = Config()
    # hypercorn adopts the descriptors: they are its sockets from here on.
    config.bind = [f"fd://{sock.detach()}" for sock in sockets]
    config.backlog = _BACKLOG
    config.keep_alive_timeout = settings.idle_timeout_s
    config.graceful_timeout = settings.shutdown_grace_s
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    # hypercorn types its messages as TypedDicts; the adapter reads them as plain mappings.
    app = cast(
        ASGIFramework,
        AsgiAdapter(handler, max_body_bytes=settings.max_body_bytes, answer_refusal=answer_refusal),
    )
    trigger = shutdown.wait if shutdown is not None else None
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, app, config, shutdown_trigger=trigger, mode="asgi"))
        task_status.started(port)

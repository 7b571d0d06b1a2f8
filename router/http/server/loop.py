"""The native HTTP/1.1 server: trio sockets, requests parsed by llhttp, one task per connection.

`serve_http` accepts connections into a connection nursery. Each connection reads one
request at a time (`router.http.server.request_reader`: the head within the header timeout and
its framing checked, the whole body within the body timeout, bounded by `max_body_bytes`
and by the server's global body budget), hands it to the handler with a `ResponseWriter`,
and keeps the connection alive when the exchange allows it. One reader task per connection does
every read of the client socket (`router.http.server.connection_reader`); while the handler runs
its pending read is the disconnect watch. Past `max_connections`, at most
`_TURN_AWAY_TASKS` connections at once are answered 503, each within `_TURN_AWAY_S`; any
more are closed at once.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Final

import trio

from router.http import clock
from router.http.direct_socket import DirectSocket
from router.http.server.batch_listener import BatchListener
from router.http.server.connection_reader import ConnectionReader, Watch
from router.http.server.exceptions import (
    AnswerRefusal,
    AtCapacity,
    HandlerFailed,
    Refusal,
    plain_refusal,
)
from router.http.server.listen import open_tcp_sockets
from router.http.server.load import ServerLoad
from router.http.server.messages import ClientDisconnected, Handler, Request
from router.http.server.request_parser import RequestParser
from router.http.server.request_reader import RequestReader
from router.http.server.response_writer import ResponseWriter
from router.http.server.settings import HttpDate, ServerSettings, encode_refusal
from router.http.wait_deadlines import WaitDeadlines

__all__ = ["ServerLoad", "ServerSettings", "serve_http"]

logger: Final = logging.getLogger("router.http.server")

_RECEIVE_BYTES: Final = 65536
# After an error answer the client may still be sending; closing with unread bytes makes
# the kernel send RST, which can destroy the answer before the client reads it.
_LINGER_S: Final = 1.0
_ACCEPT_CAPACITY_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
)
_ACCEPT_RETRY_S: Final = 0.1
_CAPACITY_WARNING_EVERY_S: Final = 10.0
# Turning a connection away costs a task, a send and a linger: bounded in number and time,
# so a flood past `max_connections` cannot grow the server's work without bound.
_TURN_AWAY_TASKS: Final = 64
_TURN_AWAY_S: Final = 1.0
_DEFAULT_SETTINGS: Final = ServerSettings()


async def serve_http(
    handler: Handler,
    settings: ServerSettings = _DEFAULT_SETTINGS,
    *,
    shutdown: trio.Event | None = None,
    load: ServerLoad | None = None,
    answer_refusal: AnswerRefusal = plain_refusal,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `handler` over HTTP/1.1 until cancelled or until `shutdown` is set.

    `load`: where the server keeps its counts and its body budget, for the caller to read
    (one of its own when not given; its `body_limit` is the caller's to set).
    `answer_refusal`: the answer to each request the server refuses on its own
    (`router.http.server.exceptions`).

    Reports the bound port through `task_status` (the first listener's, should the host
    resolve to several addresses); a bind failure raises OSError before that.
    On `shutdown`: the listeners close, idle keep-alive connections close, in-flight requests
    get `settings.shutdown_grace_s` to finish (their connections close afterwards), then
    whatever is left is cancelled and this returns.
    Cancellation: every connection is closed at once, mid-response or not.
    """
    # Every task started from here on (the connections) reads the clock the short way.
    clock.keep_clock()
    sockets = await open_tcp_sockets(settings.host, settings.port, reuse_port=settings.reuse_port)
    listeners = [BatchListener(sock) for sock in sockets]
    if load is None:
        load = ServerLoad(settings.max_buffered_body_bytes)
    server = _Server(handler, settings, load, answer_refusal)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.deadlines.serve)
            for listener in listeners:
                nursery.start_soon(server.accept_loop, listener, nursery)
            task_status.started(listeners[0].port)
            if shutdown is None:
                await trio.sleep_forever()
            else:
                await shutdown.wait()
            _close_listeners(listeners)
            server.begin_shutdown()
            with trio.move_on_after(settings.shutdown_grace_s):
                await server.wait_drained()
            nursery.cancel_scope.cancel()
    finally:
        _close_listeners(listeners)


def _close_listeners(listeners: list[BatchListener]) -> None:
    for listener in listeners:
        listener.close()


class _Server:
    """State shared by the connections of one `serve_http` call; nothing of it is global."""

    def __init__(
        self,
        handler: Handler,
        settings: ServerSettings,
        load: ServerLoad,
        answer_refusal: AnswerRefusal,
    ) -> None:
        self.handler = handler
        self.settings = settings
        self.load = load
        self.answer_refusal = answer_refusal
        self.shutting_down = False
        self.connections: set[_Connection] = set()
        self._drained = trio.Event()
        self._next_capacity_warning = float("-inf")
        self.date = HttpDate()
        # The time-outs of every connection's waits for its client (run by `serve_http`).
        self.deadlines = WaitDeadlines()

    async def accept_loop(self, listener: BatchListener, nursery: trio.Nursery) -> None:
        """Accept until the listener closes; each connection becomes a task in `nursery`.

        Every connection waiting at a wake-up is taken at once (`BatchListener`).
        """
        while True:
            try:
                accepted = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                logger.error("accept failed (%s); retrying in %ss", exc, _ACCEPT_RETRY_S)
                await trio.sleep(_ACCEPT_RETRY_S)
                continue
            for sock in accepted:
                self._admit(sock, nursery)

    def _admit(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        if len(self.connections) >= self.settings.max_connections:
            if self.load.turning_away >= _TURN_AWAY_TASKS:
                # Already answering as many as we allow: no answer, no task.
                sock.close()
                return
            self.load.turning_away += 1
            nursery.start_soon(self._turn_away, DirectSocket(sock))
            return
        # Registered before the task starts, so the cap counts it at once.
        connection = _Connection(self, sock)
        self.connections.add(connection)
        self.load.connections += 1
        nursery.start_soon(self._run_connection, connection)

    async def _run_connection(self, connection: _Connection) -> None:
        try:
            try:
                await connection.serve()
            finally:
                connection.socket.close()
        except BaseException as exc:
            # A bug in one connection must not take the server down: `except* Exception`,
            # spelled out because mypyc compiles no `except*`. The Exceptions are logged
            # as one group; anything else (a cancellation) goes on.
            if isinstance(exc, BaseExceptionGroup):
                group, rest = exc.split(Exception)
            elif isinstance(exc, Exception):
                group, rest = ExceptionGroup("", [exc]), None
            else:
                raise
            if group is not None:
                logger.error("connection from %s failed", connection.client, exc_info=group)
            if rest is not None:
                raise rest from None
        finally:
            self.connections.discard(connection)
            self.load.connections -= 1
            self._maybe_drained()

    async def _turn_away(self, stream: DirectSocket) -> None:
        now = clock.now()
        if now >= self._next_capacity_warning:
            self._next_capacity_warning = now + _CAPACITY_WARNING_EVERY_S
            logger.warning(
                "at max_connections=%d; answering new connections 503",
                self.settings.max_connections,
            )
        error = AtCapacity(f"server at its limit of {self.settings.max_connections} connections")
        try:
            with trio.move_on_after(_TURN_AWAY_S):
                data = encode_refusal(self.answer_refusal(error), self.date.now())
                try:
                    await stream.send_all(data)
                except trio.BrokenResourceError:
                    return
                await _linger(stream)
        finally:
            stream.close()
            self.load.turning_away -= 1
            self._maybe_drained()

    def begin_shutdown(self) -> None:
        """Close every connection that waits for a request; busy ones close after it."""
        self.shutting_down = True
        for connection in self.connections:
            if connection.reader.idle:
                connection.reader.expire()
        self._maybe_drained()

    async def wait_drained(self) -> None:
        """Wait until shutdown began and no connection task is left."""
        await self._drained.wait()

    def _maybe_drained(self) -> None:
        if self.shutting_down and not self.connections and not self.load.turning_away:
            self._drained.set()


class _Connection:
    """One client socket serving requests one after another: each request read by a
    parser of its own (what it holds past the request starts the next one), each answer
    written by a `ResponseWriter`."""

    __slots__ = (
        "_server",
        "client",
        "gone_scope",
        "reader",
        "refused",
        "requests",
        "socket",
        "write_timeout_s",
    )

    def __init__(self, server: _Server, sock: socket.socket) -> None:
        self._server = server
        # Called directly, without trio's per-operation checkpoint and reschedule (see
        # `DirectSocket`); closed by the connection's task when it ends.
        self.socket = DirectSocket(sock)
        settings = server.settings
        self.client = _peer(self.socket.sock)
        self.reader = ConnectionReader(self.socket, _new_parser(settings), server.deadlines)
        self.requests = RequestReader(self.reader, self.socket, settings, self.client)
        self.write_timeout_s = settings.client_write_timeout_s
        # Cancelled when the client leaves while a handler runs. One per connection, not
        # per request (a scope costs a few microseconds): a client gone ends the connection.
        self.gone_scope = trio.CancelScope()
        # A refusal was sent: the connection lingers once its reader has stopped.
        self.refused = False

    def _closing(self) -> bool:
        return self._server.shutting_down

    async def serve(self) -> None:
        """Serve requests until the client leaves, a timeout, an error, or shutdown.

        Leaves the socket open; the caller closes it. The reader task stops first.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.reader.run)
            try:
                with self.gone_scope:
                    await self._serve_requests()
            finally:
                self.reader.stop()
        if self.refused:
            # Only now that the reader task has ended: a socket has one reader at a time,
            # and a reader woken just before the refusal may not have seen its stop yet.
            await _linger(self.socket)

    async def _serve_requests(self) -> None:
        server = self._server
        deadline: float | None = clock.now() + server.settings.header_timeout_s
        while True:
            # The body's bytes count against the server's budget until the handler is done.
            reservation = server.load.reservation()
            try:
                try:
                    request = await self.requests.read(
                        deadline, reservation, shutting_down=server.shutting_down
                    )
                except Refusal as error:
                    await self._refuse(error)
                    return
                if request is None:
                    return
                if not await self._run_handler(request) or server.shutting_down:
                    return
            finally:
                reservation.release()
            self._next_parser()
            deadline = None

    async def _run_handler(self, request: Request) -> bool:
        """Run the handler, watched for a client that leaves; True when the connection can
        be reused.

        The watch is the reader task's pending read (no task per request): end-of-stream
        before the response's last bytes went out cancels the handler, and with it the
        connection (`gone_scope`).
        Cancellation (shutdown grace over): the handler is cancelled with everything else.
        """
        writer = ResponseWriter(
            self.socket,
            request,
            http_version=self.requests.http_version,
            date=self._server.date.now,
            closing=self._closing,
            write_timeout_s=self.write_timeout_s,
        )
        failure: Exception | None = None
        self.reader.watch = Watch(request, writer, self.gone_scope)
        if self.reader.ended:
            # The client left (or half-closed) before its handler started: as if the watch
            # had seen it at once.
            request.client_gone = True
            self.gone_scope.cancel()
        else:
            self.reader.arm()
        try:
            await self._server.handler(request, writer)
        except Exception as exc:
            failure = exc
        finally:
            self.reader.watch = None
        if request.client_gone or writer.aborted or isinstance(failure, ClientDisconnected):
            return False
        if failure is not None or not writer.finished:
            outcome = "raised" if failure is not None else "gave no complete response"
            logger.error(
                "handler %s: %s %s", outcome, request.method, request.path, exc_info=failure
            )
        if not writer.started:
            # Nothing went out yet: a clean 500 keeps the connection usable.
            status, headers, body = self._server.answer_refusal(
                HandlerFailed("internal error while handling the request")
            )
            try:
                await writer.respond(status, headers, body)
            except ClientDisconnected:
                return False
        # A half-sent response is never followed by another one on the same connection.
        return writer.keeps_connection

    def _next_parser(self) -> None:
        """A fresh parser for the next request, given what the last one held past its request
        (pipelined bytes, and end-of-stream when the client already closed)."""
        data, closed = self.reader.parser.trailing_data
        parser = _new_parser(self._server.settings)
        if data:
            parser.receive_data(bytes(data))
        if closed:
            parser.receive_data(b"")
        self.reader.parser = parser

    async def _refuse(self, error: Refusal) -> None:
        """Answer `error` with `connection: close`; `serve` then lingers so that the client
        can read it. Send failures are ignored: the client is gone.
        """
        bodyless = self.requests.method == b"HEAD"
        data = encode_refusal(
            self._server.answer_refusal(error), self._server.date.now(), bodyless=bodyless
        )
        try:
            await self.socket.send_all(data, stall_timeout_s=self.write_timeout_s)
        except trio.BrokenResourceError:
            return
        self.refused = True


async def _linger(stream: DirectSocket) -> None:
    """Half-close, then drain what the client still sends, for at most `_LINGER_S`."""
    with trio.move_on_after(_LINGER_S):
        try:
            await stream.send_eof()
            while await stream.receive_some(_RECEIVE_BYTES):
                pass
        except trio.BrokenResourceError:
            pass


def _new_parser(settings: ServerSettings) -> RequestParser:
    return RequestParser(settings.max_header_bytes, settings.max_body_bytes)


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    try:
        address = sock.getpeername()
    except OSError:
        return None
    return (address[0], address[1])

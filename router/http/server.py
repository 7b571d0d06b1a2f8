"""The native HTTP/1.1 server: trio sockets driven by h11, one task per connection.

`serve_http` accepts connections into a connection nursery. Each connection reads one
request at a time (head bounded by h11's incomplete-event limit, body bounded by
`max_body_bytes`), hands it to the handler with a `ResponseWriter`, and keeps the
connection alive when h11 allows it. One reader task per connection does every read of
the client socket; while the handler runs its pending read is the disconnect watch:
end-of-stream means the client left and cancels the handler; bytes mean a pipelined next
request, kept in h11's buffer for the next cycle.
"""

from __future__ import annotations

import errno
import logging
import socket

import h11
import trio

from router.errors import HeadersTooLarge, PayloadTooLarge, RequestTimeout, RouterError, ServerBusy
from router.http.direct_socket import DirectSocket
from router.http.listen import open_tcp_sockets
from router.http.messages import ClientDisconnected, Handler, Request
from router.http.response_writer import ResponseWriter
from router.http.server_settings import (
    JSON_HEADER,
    HttpDate,
    ServerSettings,
    encode_error,
    protocol_error,
)

__all__ = ["ServerSettings", "serve_http"]

logger = logging.getLogger(__name__)

_RECEIVE_BYTES = 65536
# After an error answer the client may still be sending; closing with unread bytes makes
# the kernel send RST, which can destroy the answer before the client reads it.
_LINGER_S = 1.0
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_RETRY_S = 0.1
_CAPACITY_WARNING_EVERY_S = 10.0
_DEFAULT_SETTINGS = ServerSettings()


async def serve_http(
    handler: Handler,
    settings: ServerSettings = _DEFAULT_SETTINGS,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `handler` over HTTP/1.1 until cancelled or until `shutdown` is set.

    Reports the bound port through `task_status` (the first listener's, should the host
    resolve to several addresses); a bind failure raises OSError before that.
    On `shutdown`: the listeners close, idle keep-alive connections close, in-flight requests
    get `settings.shutdown_grace_s` to finish (their connections close afterwards), then
    whatever is left is cancelled and this returns.
    Cancellation: every connection is closed at once, mid-response or not.
    """
    if settings.reuse_port:
        sockets = await open_tcp_sockets(settings.host, settings.port, reuse_port=True)
        listeners = [trio.SocketListener(sock) for sock in sockets]
    else:
        listeners = await trio.open_tcp_listeners(settings.port, host=settings.host)
    server = _Server(handler, settings)
    try:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(server.accept_loop, listener, nursery)
            task_status.started(listeners[0].socket.getsockname()[1])
            if shutdown is None:
                await trio.sleep_forever()
            else:
                await shutdown.wait()
            await _close_listeners(listeners)
            server.begin_shutdown()
            with trio.move_on_after(settings.shutdown_grace_s):
                await server.wait_drained()
            nursery.cancel_scope.cancel()
    finally:
        await _close_listeners(listeners)


async def _close_listeners(listeners: list[trio.SocketListener]) -> None:
    # Shielded: closing is instant, and a cancelled first close must not skip the rest.
    with trio.CancelScope(shield=True):
        for listener in listeners:
            await listener.aclose()


class _Server:
    """State shared by the connections of one `serve_http` call; nothing of it is global."""

    def __init__(self, handler: Handler, settings: ServerSettings) -> None:
        self.handler = handler
        self.settings = settings
        self.shutting_down = False
        self.connections: set[_Connection] = set()
        self._turning_away = 0
        self._drained = trio.Event()
        self._next_capacity_warning = float("-inf")
        self.date = HttpDate()

    async def accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept until the listener closes; each connection becomes a task in `nursery`."""
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                logger.error("accept failed (%s); retrying in %ss", exc, _ACCEPT_RETRY_S)
                await trio.sleep(_ACCEPT_RETRY_S)
                continue
            if len(self.connections) >= self.settings.max_connections:
                self._turning_away += 1
                nursery.start_soon(self._turn_away, stream)
                continue
            # Registered before the task starts, so the cap counts it at once.
            connection = _Connection(self, stream)
            self.connections.add(connection)
            nursery.start_soon(self._run_connection, connection)

    async def _run_connection(self, connection: _Connection) -> None:
        try:
            try:
                await connection.serve()
            finally:
                connection.socket.close()
        except* Exception as group:
            # A bug in one connection must not take the server down.
            logger.error("connection from %s failed", connection.client, exc_info=group)
        finally:
            self.connections.discard(connection)
            self._maybe_drained()

    async def _turn_away(self, stream: trio.SocketStream) -> None:
        now = trio.current_time()
        if now >= self._next_capacity_warning:
            self._next_capacity_warning = now + _CAPACITY_WARNING_EVERY_S
            logger.warning(
                "at max_connections=%d; answering new connections 503",
                self.settings.max_connections,
            )
        error = ServerBusy(f"server at its limit of {self.settings.max_connections} connections")
        try:
            async with stream:
                conn = h11.Connection(h11.SERVER)
                data = encode_error(conn, error, self.date.now())
                try:
                    await stream.send_all(data)
                except trio.BrokenResourceError:
                    return
                await _linger(stream)
        finally:
            self._turning_away -= 1
            self._maybe_drained()

    def begin_shutdown(self) -> None:
        """Close every connection that waits for a request; busy ones close after it."""
        self.shutting_down = True
        for connection in self.connections:
            if connection.idle_scope is not None:
                connection.idle_scope.cancel()
        self._maybe_drained()

    async def wait_drained(self) -> None:
        """Wait until shutdown began and no connection task is left."""
        await self._drained.wait()

    def _maybe_drained(self) -> None:
        if self.shutting_down and not self.connections and not self._turning_away:
            self._drained.set()


class _Connection:
    """One client socket and its h11 state machine, serving requests one after another."""

    __slots__ = (
        "_main_waiter",
        "_reader",
        "_reader_armed",
        "_reader_broken",
        "_reader_parked",
        "_reader_scope",
        "_server",
        "_watched",
        "client",
        "h11",
        "idle_scope",
        "socket",
    )

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self._server = server
        # Called directly, without trio's per-operation checkpoint and reschedule (see
        # `DirectSocket`); closed by the connection's task when it ends.
        self.socket = DirectSocket.adopt(stream)
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.settings.max_header_bytes
        )
        self.client = _peer(self.socket.sock)
        # Set while waiting for the first byte of a request: shutdown cancels it.
        self.idle_scope: trio.CancelScope | None = None
        # One reader task per connection does every read of the client socket (see
        # `_read_loop`); these fields are how it and the connection's task hand over.
        self._reader: trio.lowlevel.Task | None = None
        self._reader_scope = trio.CancelScope()
        self._reader_armed = False
        self._reader_parked = False
        self._reader_broken: trio.BrokenResourceError | None = None
        self._main_waiter: trio.lowlevel.Task | None = None
        self._watched: tuple[Request, ResponseWriter, trio.CancelScope] | None = None

    async def serve(self) -> None:
        """Serve requests until the client leaves, a timeout, an error, or shutdown.

        Leaves the socket open; the caller closes it. The reader task stops first.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_loop)
            try:
                await self._serve_requests()
            finally:
                self._reader_scope.cancel()

    async def _serve_requests(self) -> None:
        server = self._server
        deadline: float | None = trio.current_time() + server.settings.header_timeout_s
        while True:
            request = await self._read_request(deadline)
            if request is None:
                return
            if not await self._run_handler(request) or server.shutting_down:
                return
            self.h11.start_next_cycle()
            deadline = None

    async def _read_request(self, deadline: float | None) -> Request | None:
        """Read one request head and body; None when the connection must close.

        Every refusal (400, 408, 413, 431) is answered here, with `connection: close`.
        """
        try:
            head = await self._read_head(deadline)
            if head is None:
                return None
            return await self._read_body(head)
        except h11.RemoteProtocolError as exc:
            await self._refuse(protocol_error(exc, self._server.settings))
            return None
        except trio.BrokenResourceError:
            return None

    async def _read_head(self, deadline: float | None) -> h11.Request | None:
        """Wait for the next request head.

        `deadline` bounds the whole head (first request); None means a keep-alive wait: the
        idle timeout until a first byte, then the header timeout from that byte.
        """
        conn = self.h11
        settings = self._server.settings
        event = conn.next_event()
        if event is h11.NEED_DATA:
            waiting = not conn.trailing_data[0]
            if waiting and self._server.shutting_down:
                return None
            keep_alive_wait = deadline is None
            if deadline is None:
                timeout = settings.idle_timeout_s if waiting else settings.header_timeout_s
                deadline = trio.current_time() + timeout
            while event is h11.NEED_DATA:
                with trio.CancelScope(deadline=deadline) as scope:
                    if waiting:
                        self.idle_scope = scope
                    try:
                        await self._receive()
                    finally:
                        self.idle_scope = None
                if scope.cancelled_caught:
                    if not waiting:
                        await self._refuse(RequestTimeout("request headers took too long"))
                    return None
                if waiting and keep_alive_wait:
                    deadline = trio.current_time() + settings.header_timeout_s
                waiting = False
                event = conn.next_event()
        if type(event) is h11.Request:
            return event
        return None

    async def _read_body(self, head: h11.Request) -> Request | None:
        """Check the head's limits, then read the whole body (413 past `max_body_bytes`)."""
        conn = self.h11
        settings = self._server.settings
        limit = settings.max_body_bytes
        headers = list(head.headers)
        # h11 bounds only a head still incomplete; one that arrived whole in a single read
        # is measured here (lines without their CRLFs and colons: close enough for a bound).
        head_bytes = len(head.method) + len(head.target)
        declared = 0
        for name, value in headers:
            head_bytes += len(name) + len(value)
            if name == b"content-length":
                declared = int(value)
        if head_bytes > settings.max_header_bytes:
            await self._refuse(
                HeadersTooLarge(f"request headers exceed {settings.max_header_bytes} bytes")
            )
            return None
        if declared > limit:
            await self._refuse(PayloadTooLarge(f"request body exceeds {limit} bytes"))
            return None
        if conn.they_are_waiting_for_100_continue:
            await self.socket.send_all(
                conn.send(h11.InformationalResponse(status_code=100, headers=[]))
            )
        chunks: list[bytes | bytearray] = []
        size = 0
        event = conn.next_event()
        while type(event) is not h11.EndOfMessage:
            if type(event) is h11.Data:
                size += len(event.data)
                if size > limit:
                    await self._refuse(PayloadTooLarge(f"request body exceeds {limit} bytes"))
                    return None
                chunks.append(event.data)
            else:
                with trio.move_on_after(settings.header_timeout_s) as scope:
                    await self._receive()
                if scope.cancelled_caught:
                    await self._refuse(RequestTimeout("request body stalled"))
                    return None
            event = conn.next_event()
        return Request(
            method=head.method.decode("latin-1"),
            target=head.target.decode("latin-1"),
            headers=headers,
            body=b"".join(chunks),
            client=self.client,
        )

    async def _run_handler(self, request: Request) -> bool:
        """Run the handler, watched for a client that leaves; True when the connection can
        be reused.

        The watch is the reader task's pending read (no task per request): end-of-stream
        before the response's last bytes went out cancels the handler.
        Cancellation (shutdown grace over): the handler is cancelled with everything else.
        """
        writer = ResponseWriter(self, request)
        handler_scope = trio.CancelScope()
        failure: Exception | None = None
        self._watched = (request, writer, handler_scope)
        self._arm_reader()
        try:
            with handler_scope:
                await self._server.handler(request, writer)
        except Exception as exc:
            failure = exc
        finally:
            self._watched = None
        if request.client_gone or writer.aborted or isinstance(failure, ClientDisconnected):
            return False
        if failure is not None or not writer.finished:
            outcome = "raised" if failure is not None else "gave no complete response"
            logger.error(
                "handler %s: %s %s", outcome, request.method, request.path, exc_info=failure
            )
        if not writer.started and self.h11.our_state is h11.SEND_RESPONSE:
            # Nothing went out yet: a clean 500 keeps the connection usable.
            error = RouterError("internal error while handling the request")
            try:
                await writer.respond(error.status, [JSON_HEADER, *error.headers()], error.body())
            except ClientDisconnected:
                return False
        # A half-sent response is never followed by another one on the same connection.
        return (
            writer.finished and self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE
        )

    async def _read_loop(self) -> None:
        """The connection's only reader of the client socket, one read per arming.

        Armed by the connection's task when h11 needs bytes, and when a handler starts. What
        a read brings goes to h11's buffer: a request's bytes, or a pipelined next request
        while a handler runs (the reader then stops until armed again, so a later
        disconnect shows as a failed send). End-of-stream while a handler runs, before the
        response's last bytes went out, means the client left: the handler is cancelled. A
        client that closes once the whole response is on its way is done, not gone: the
        handler's bookkeeping after the response is left to finish.
        Cancellation: stops at once; no byte is lost (a pending read consumed nothing).
        """
        self._reader = trio.lowlevel.current_task()
        with self._reader_scope:
            while True:
                if not self._reader_armed:
                    self._reader_parked = True
                    await trio.lowlevel.wait_task_rescheduled(self._abort_reader_park)
                try:
                    data = await self.socket.receive_some(_RECEIVE_BYTES)
                except trio.BrokenResourceError as exc:
                    data = b""
                    self._reader_broken = exc
                self._reader_armed = False
                watched = self._watched
                if watched is None or data:
                    if data or self._reader_broken is None:
                        self.h11.receive_data(data)
                else:
                    request, writer, handler_scope = watched
                    if writer.ending:
                        self.h11.receive_data(b"")
                    else:
                        request.client_gone = True
                        handler_scope.cancel()
                waiter = self._main_waiter
                if waiter is not None:
                    self._main_waiter = None
                    trio.lowlevel.reschedule(waiter)
                if not data:
                    return

    def _abort_reader_park(self, _: object) -> trio.lowlevel.Abort:
        self._reader_parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    def _arm_reader(self) -> None:
        self._reader_armed = True
        if self._reader_parked:
            self._reader_parked = False
            assert self._reader is not None
            trio.lowlevel.reschedule(self._reader)

    async def _receive(self) -> None:
        """Wait until the reader gave h11 more bytes, or end-of-stream.

        Raises BrokenResourceError when the client reset the connection. Cancellation
        (timeouts, shutdown): the reader's read stays pending; what it brings still goes
        to h11.
        """
        if self._reader_broken is not None:
            raise trio.BrokenResourceError("the client reset the connection")
        self._arm_reader()
        self._main_waiter = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_main_wait)
        if self._reader_broken is not None:
            raise trio.BrokenResourceError("the client reset the connection")

    def _abort_main_wait(self, _: object) -> trio.lowlevel.Abort:
        self._main_waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _refuse(self, error: RouterError) -> None:
        """Answer `error` with `connection: close` when h11 still allows an answer, then
        linger so the client can read it. Send failures are ignored: the client is gone.
        """
        conn = self.h11
        if conn.our_state is h11.IDLE or conn.our_state is h11.SEND_RESPONSE:
            try:
                await self.socket.send_all(encode_error(conn, error, self._server.date.now()))
            except trio.BrokenResourceError:
                return
        # The reader's pending read would compete with the linger's reads.
        self._reader_scope.cancel()
        await _linger(self.socket)


async def _linger(stream: trio.SocketStream | DirectSocket) -> None:
    """Half-close, then drain what the client still sends, for at most `_LINGER_S`."""
    with trio.move_on_after(_LINGER_S):
        try:
            await stream.send_eof()
            while await stream.receive_some(_RECEIVE_BYTES):
                pass
        except trio.BrokenResourceError:
            pass


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    try:
        address = sock.getpeername()
    except OSError:
        return None
    return (address[0], address[1])

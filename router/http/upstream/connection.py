"""One HTTP/1.1 client connection to a worker: a socket, our framing and llhttp's parsing.

The request is one join; the response head's end is one `find`, and the head is parsed by
llhttp behind our checks (`router.http.upstream.parser`). The body's framing is decided
here from the headers (RFC 9112 section 6.3): by content-length (counted out of the
received bytes), by chunked coding (decoded by llhttp as the bytes arrive), or by the end
of the connection when the head gives neither. A head or a body that is not HTTP/1.1 is
refused with `UpstreamProtocolError`.

This module is the edge where socket and framing errors become `UpstreamError`s; nothing
above it sees a `BrokenResourceError` or an `OSError`. It knows nothing of pooling:
`router.http.upstream.pool` decides when a connection is opened, reused or closed.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import socket
from collections.abc import Awaitable
from typing import Final

import trio

from router.http.direct_socket import DirectSocket
from router.http.upstream.exceptions import (
    LocalShortage,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    local_errno_kind,
)
from router.http.upstream.parser import UpstreamParser, header_tokens
from router.http.upstream.request_encoding import encode_request
from router.http.wait_deadlines import WaitDeadlines

__all__ = [
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamConnection",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "encode_request",
    "ip_literal_family",
    "open_upstream_connection",
]

_RECEIVE_SIZE: Final = 65536
# The bound on what is buffered while looking for a head's end: h11's default is 16 KiB;
# engines send a few hundred bytes.
_MAX_HEAD_BYTES: Final = 65536
# 100 Continue and 103 Early Hints come once or twice; a worker sending more is broken,
# and each would otherwise cost a head parse while the client waits.
_MAX_INTERIM_RESPONSES: Final = 8

# What a worker (or the network) can do to an open connection.
_TRANSPORT_ERRORS: Final = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

# Body framing of the response in progress.
_ENDED: Final = 0
_LENGTH: Final = 1
_CHUNKED: Final = 2
_UNTIL_EOF: Final = 3
_BROKEN: Final = 4


class UpstreamConnection:
    """A connected socket and the framing state of the response it carries.

    `idle_since` is written by the pool when the connection is returned to it.
    """

    __slots__ = (
        "_buffer",
        "_deadlines",
        "_framing",
        "_keep_alive",
        "_left",
        "_parser",
        "_position",
        "_socket",
        "idle_since",
        "response_started",
        "timed_out",
        "wait_deadline",
        "wait_number",
    )

    def __init__(self, stream: trio.SocketStream) -> None:
        # The socket is called directly (see `DirectSocket`); trio's SocketStream already
        # turned TCP_NODELAY on, which a request/response protocol with small heads needs.
        self._socket = DirectSocket.adopt(stream)
        # Received bytes not parsed yet start at `_position` (kept as an offset: no copy
        # per parsed line).
        self._buffer = b""
        self._position = 0
        self._framing = _ENDED
        # The parser of the response in progress: it decodes a chunked body.
        self._parser: UpstreamParser | None = None
        self._left = 0
        self._keep_alive = False
        self.idle_since = 0.0
        self.response_started = False
        # The head's deadline, as `WaitDeadlines` reads it: `expire` closes the connection.
        self.timed_out = False
        self.wait_deadline = math.inf
        self.wait_number = 0
        self._deadlines: WaitDeadlines | None = None

    async def exchange(
        self,
        request: bytes,
        *,
        bodyless: bool = False,
        deadline: float = math.inf,
        deadlines: WaitDeadlines | None = None,
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Sends one encoded request and waits for the final response head (1xx are skipped).

        Returns the status and the headers (names lower-case). `bodyless` says the request
        was HEAD: its response has no body whatever the head says. With `deadlines`, the
        head is due by `deadline`: past it the timer closes the connection and this raises
        `UpstreamTimeout` (a time-out with no cancel scope: see
        `router.http.wait_deadlines`).
        Raises `UpstreamProtocolError` with `response_started` telling whether any response
        byte arrived. Cancellation: the connection is left mid-exchange; the caller must
        close it.
        """
        self.response_started = False
        self._framing = _BROKEN
        self._deadlines = deadlines
        timed = deadlines is not None and deadline != math.inf
        if timed:
            assert deadlines is not None
            self.wait_number += 1
            self.wait_deadline = deadline
            deadlines.waiting(self)
        try:
            # One write: with TCP_NODELAY, separate writes would be separate packets.
            await self._socket.send_all(request)
            interim = 0
            while True:
                end = self._buffer.find(b"\r\n\r\n", self._position)
                if end < 0 and self._position == len(self._buffer):
                    # The common case: the whole head arrives in the first read.
                    if not await self._receive():
                        raise self._closed_before_head()
                    end = self._buffer.find(b"\r\n\r\n", self._position)
                if end < 0:
                    end = await self._receive_split_head()
                if end - self._position > _MAX_HEAD_BYTES:
                    raise UpstreamProtocolError(
                        f"upstream response head exceeds {_MAX_HEAD_BYTES} bytes",
                        response_started=True,
                    )
                head = self._buffer[self._position : end + 4]
                self._position = end + 4
                parser = UpstreamParser()
                status, headers, keep_alive = parser.parse_head(head)
                if status >= 200:
                    break
                if status == 101:
                    raise UpstreamProtocolError(
                        "upstream switched protocols unasked", response_started=True
                    )
                interim += 1
                if interim > _MAX_INTERIM_RESPONSES:
                    raise UpstreamProtocolError(
                        f"upstream sent more than {_MAX_INTERIM_RESPONSES} interim (1xx) responses",
                        response_started=True,
                    )
            self._keep_alive = keep_alive
            self._start_body(status, headers, bodyless, parser)
        except _TRANSPORT_ERRORS as exc:
            if self.timed_out:
                raise UpstreamTimeout(
                    "no response head by the deadline", response_started=self.response_started
                ) from None
            raise UpstreamProtocolError(
                _describe(exc, "before the response head"),
                response_started=self.response_started,
            ) from exc
        finally:
            if timed:
                assert deadlines is not None
                self.wait_deadline = math.inf
                deadlines.done(self)
        return status, headers

    def expire(self) -> None:
        """The head's deadline passed: close the connection, waking the exchange."""
        self.timed_out = True
        self._socket.close()

    async def _receive_split_head(self) -> int:
        """Reads until a head that spans several reads is whole; returns where it ends.

        The pieces gather in one bytearray and each read is searched only where the end
        can be (its bytes and the three before), so a worker that drips its head byte by
        byte costs linear time, not quadratic. Raises `UpstreamProtocolError` past
        `_MAX_HEAD_BYTES` or when the worker closes first.
        """
        pending = bytearray(self._buffer[self._position :])
        while len(pending) <= _MAX_HEAD_BYTES:
            searched = len(pending)
            data = await self._socket.receive_some(_RECEIVE_SIZE)
            if not data:
                raise self._closed_before_head()
            self.response_started = True
            pending += data
            end = pending.find(b"\r\n\r\n", max(0, searched - 3))
            if end >= 0:
                self._buffer = bytes(pending)
                self._position = 0
                return end
        raise UpstreamProtocolError(
            f"upstream response head exceeds {_MAX_HEAD_BYTES} bytes", response_started=True
        )

    def _closed_before_head(self) -> UpstreamProtocolError:
        return UpstreamProtocolError(
            "upstream closed the connection before the response head",
            response_started=self.response_started,
        )

    def _start_body(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        bodyless: bool,
        parser: UpstreamParser,
    ) -> None:
        """Sets the body framing from the head (RFC 9112 section 6.3); keeps `parser`, which
        parsed the head, to decode a chunked body."""
        self._parser = None
        if bodyless or status == 204 or status == 304:
            # No body whatever the head says, but a `connection: close` still holds.
            if any(n == b"connection" and b"close" in header_tokens(v) for n, v in headers):
                self._keep_alive = False
            self._framing = _ENDED
            return
        length: bytes | None = None
        coding: bytes | None = None
        for name, value in headers:
            if name == b"content-length":
                if length is not None and value != length:
                    raise UpstreamProtocolError(
                        "upstream sent conflicting content-length headers", response_started=True
                    )
                length = value
            elif name == b"transfer-encoding":
                coding = value if coding is None else coding + b", " + value
            elif name == b"connection" and b"close" in header_tokens(value):
                self._keep_alive = False
        if coding is not None:
            if length is not None or coding.lower() != b"chunked":
                raise UpstreamProtocolError(
                    f"upstream body framing not supported: transfer-encoding {coding!r}"
                    + (" with a content-length" if length is not None else ""),
                    response_started=True,
                )
            parser.expect_chunked()
            self._parser = parser
            self._framing = _CHUNKED
        elif length is not None:
            # `find`, not `in`: docs/performance.md, "fifth round".
            if length.find(b",") >= 0:
                # "5, 5" is one length repeated by a proxy; anything else is ambiguous.
                values = {part.strip() for part in length.split(b",")}
                length = values.pop() if len(values) == 1 else b"x"
            if not length.isdigit():
                raise UpstreamProtocolError(
                    f"upstream sent an invalid content-length {length!r}", response_started=True
                )
            self._left = int(length)
            self._framing = _LENGTH if self._left else _ENDED
        else:
            # Neither: the body runs until the worker closes, so the connection cannot
            # carry another request.
            self._keep_alive = False
            self._framing = _UNTIL_EOF

    async def receive_data_by(self, deadline: float) -> bytes:
        """`receive_data`, or `UpstreamTimeout` when no byte came by `deadline` (kept by the
        timer the head's was, else by a cancel scope)."""
        deadlines = self._deadlines
        if deadlines is None or not deadlines.serving:
            with trio.CancelScope(deadline=deadline):
                return await self.receive_data()
            self._framing = _BROKEN
            raise UpstreamTimeout("no body bytes by the deadline", response_started=True)
        self.wait_number += 1
        self.wait_deadline = deadline
        deadlines.waiting(self)
        try:
            return await self.receive_data()
        except UpstreamProtocolError:
            if self.timed_out:
                raise UpstreamTimeout(
                    "no body bytes by the deadline", response_started=True
                ) from None
            raise
        finally:
            self.wait_deadline = math.inf
            deadlines.done(self)

    async def receive_data(self) -> bytes:
        """Returns the next body bytes as they arrive, b"" once the body has ended.

        Bytes of several chunks already received come back together. Raises
        `UpstreamProtocolError` (response_started=True) on reset, early EOF or a malformed
        body, and again on every later call. Cancellation: the connection is left
        mid-body; the caller must close it.
        """
        framing = self._framing
        if framing == _ENDED:
            return b""
        if framing == _BROKEN:
            raise UpstreamProtocolError(
                "the response body broke off earlier", response_started=True
            )
        try:
            while True:
                if framing == _LENGTH:
                    data = self._take_length()
                elif framing == _CHUNKED:
                    data = self._take_chunked()
                else:
                    data = self._take_all()
                if data or self._framing == _ENDED:
                    return data
                # `_receive`, written out: a coroutine fewer per relayed event.
                received = await self._socket.receive_some(_RECEIVE_SIZE)
                if not received:
                    if framing == _UNTIL_EOF:
                        self._framing = _ENDED
                        return b""
                    raise UpstreamProtocolError(
                        "upstream closed the connection before the body ended",
                        response_started=True,
                    )
                self._take_in(received)
        except UpstreamProtocolError:
            self._framing = _BROKEN
            raise
        except _TRANSPORT_ERRORS as exc:
            self._framing = _BROKEN
            raise UpstreamProtocolError(
                _describe(exc, "during the response body"), response_started=True
            ) from exc

    def body_ended(self) -> bool:
        """Whether the body's end has been received (and every byte of it handed out)."""
        return self._framing == _ENDED

    def take_whole_body(self) -> bytes | None:
        """The whole body when the bytes already received hold all of it, without waiting:
        b"" for a body already ended, None (nothing taken) when more must arrive or the
        body is not framed by a length."""
        framing = self._framing
        if framing == _ENDED:
            return b""
        if framing == _LENGTH and len(self._buffer) - self._position >= self._left:
            return self._take_length()
        return None

    def _take_length(self) -> bytes:
        buffer = self._buffer
        start = self._position
        end = min(len(buffer), start + self._left)
        if end == start:
            return b""
        self._left -= end - start
        self._position = end
        if not self._left:
            self._framing = _ENDED
        return buffer if start == 0 and end == len(buffer) else buffer[start:end]

    def _take_all(self) -> bytes:
        data = self._buffer[self._position :]
        self._position = len(self._buffer)
        return data

    def _take_chunked(self) -> bytes:
        """Hands llhttp every byte received and not parsed yet; returns the data bytes.

        Bytes beyond the body's end are dropped and make the connection non-reusable.
        """
        buffer = self._buffer
        position = self._position
        if position == len(buffer):
            return b""
        self._position = len(buffer)
        parser = self._parser
        assert parser is not None
        data = parser.feed_chunked(buffer[position:] if position else buffer)
        if parser.complete:
            self._framing = _ENDED
            if parser.beyond:
                self._keep_alive = False
        return data

    async def _receive(self) -> bool:
        """Appends the next received bytes to the buffer; False at end-of-stream."""
        data = await self._socket.receive_some(_RECEIVE_SIZE)
        if not data:
            return False
        self._take_in(data)
        return True

    def _take_in(self, data: bytes) -> None:
        """Appends received bytes to the buffer, after what is left unparsed of it."""
        self.response_started = True
        if self._position < len(self._buffer):
            self._buffer = self._buffer[self._position :] + data
        else:
            self._buffer = data
        self._position = 0

    def recycle(self) -> bool:
        """Readies the connection for the next request; False when it must not carry one.

        Only a response read to its end, on HTTP/1.1 without `connection: close`, with no
        byte beyond its end, leaves a connection that can be reused.
        """
        return self._framing == _ENDED and self._keep_alive and self._position == len(self._buffer)

    def peer_is_silent(self) -> bool:
        """Whether the worker has neither closed this idle connection nor written to it."""
        return self._socket.peer_is_silent()

    def close(self) -> None:
        """Closes the socket at once (no checkpoint), waking any task blocked on it.

        Unread data makes the kernel send a reset, which is what a half-read response
        deserves.
        """
        self._socket.close()


def _describe(exc: BaseException, where: str) -> str:
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"upstream connection failed {where}: {type(exc).__name__}: {exc}"


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection was made within the caller's connect deadline."""


def ip_literal_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 when `host` is an IP literal; None for a name, which is resolved
    at each connect (a record behind it may move)."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return None
    return socket.AF_INET if version == 4 else socket.AF_INET6


async def open_upstream_connection(
    host: str,
    port: int,
    base_url: str,
    timeout_s: float | None,
    family: socket.AddressFamily | None = None,
) -> UpstreamConnection:
    """A new connection to `host:port` (the worker at `base_url`), within `timeout_s`.

    `family` (`ip_literal_family(host)`): an IP literal is connected to at once, one
    socket and one connect; a name (None) goes through `trio.open_tcp_stream`, which
    resolves it and tries each address it has. The literal's way costs a third of the CPU,
    which a burst of new connections spends all at once (docs/performance.md, "sixth
    round").
    Cancellation: any half-made connection is closed.
    """
    # A connect that hangs (a SYN dropped by a full backlog or a firewall) would otherwise
    # eat the whole first-byte deadline, which is sized for a slow prefill, not for a
    # worker that is not there.
    with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as deadline:
        try:
            if family is None:
                stream = await trio.open_tcp_stream(host, port)
            else:
                stream = await _connect_literal(family, host, port)
        except OSError as exc:
            kind = local_errno_kind(exc)
            if kind is not None:
                raise LocalShortage(
                    kind,
                    f"cannot connect to {base_url}: the router is short of local resources "
                    f"({kind}): {exc}",
                ) from exc
            raise UpstreamConnectError(f"cannot connect to {base_url}: {exc}") from exc
    if deadline.cancelled_caught:
        raise UpstreamConnectTimeout(
            f"cannot connect to {base_url}: no connection within {timeout_s:g}s"
        )
    return UpstreamConnection(stream)


async def _connect_literal(family: socket.AddressFamily, host: str, port: int) -> trio.SocketStream:
    """One socket, one connect. A connect that completes within the call (toward a worker
    on the same host, the kernel finishes the handshake before `connect` returns, though it
    still says EINPROGRESS) goes on at once; any other waits until the socket is writable.
    Cancellation (a cancel point before the connect, and the wait): the socket is closed."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await trio.lowlevel.checkpoint_if_cancelled()
        error = sock.connect_ex((host, port))
        if error == errno.EINPROGRESS:
            if _connected(sock):
                error = 0
            else:
                await trio.lowlevel.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, f"connecting to {host} port {port}: {os.strerror(error)}")
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


class UpstreamResponse:
    """A response whose head has arrived; the body is read on demand."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(
        self, connection: UpstreamConnection, status: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._connection = connection
        self.status = status
        self.headers = headers

    def receive_some(self, deadline: float = math.inf) -> Awaitable[bytes]:
        """The next body bytes as they arrive (await it); b"" once the body has ended.

        Raises `UpstreamProtocolError` (response_started=True) when the body breaks off,
        `UpstreamTimeout` when nothing came by `deadline`. Cancellation: the request's
        context manager closes the connection.

        Not a coroutine of its own: the connection's is awaited directly, one coroutine
        fewer per relayed event.
        """
        if deadline == math.inf:
            return self._connection.receive_data()
        return self._connection.receive_data_by(deadline)

    def body_ended(self) -> bool:
        """Whether the body has ended with the bytes handed out so far: the next
        `receive_some` returns b"" without waiting."""
        return self._connection.body_ended()

    def abandon(self) -> None:
        """Give the answer up now (no checkpoint): the connection closes, a
        `receive_some` in progress or later raises `UpstreamProtocolError`, and the
        connection never returns to the pool."""
        self._connection.expire()

    def take_whole_body(self) -> bytes | None:
        """The whole body when it has already arrived (no wait, so no timeout to set);
        None when it has not, with nothing taken."""
        return self._connection.take_whole_body()

    async def read(self) -> bytes:
        """The whole remaining body. Errors and cancellation as `receive_some`."""
        chunks = []
        while chunk := await self._connection.receive_data():
            chunks.append(chunk)
        return b"".join(chunks)

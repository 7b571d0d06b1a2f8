"""The native server's `ResponseWriter`: an answer onto one client connection.

Built from what it answers on: the client socket, the source of the `Date` value, and the
server's closing flag (a closing server ends each connection after its answer). The bytes
are written here (`router.http.server.response_framing` decides the head and the framing), no
HTTP library in between; the tests compare them byte for byte with h11's.
"""

from __future__ import annotations

import functools
import socket
import struct
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

import trio

from router.http.direct_socket import DirectSocket, SendStalled
from router.http.server.messages import ClientDisconnected, Headers, Request
from router.http.server.response_framing import (
    CHUNKED,
    LENGTH,
    ResponseError,
    encode_head,
    request_keeps_alive,
)
from router.http.server.settings import CLOSE_HEADER, SERVER_HEADER

__all__ = ["ResponseWriter"]

_NO_BODY_STATUSES: Final = frozenset({204, 304})


class ResponseWriter:
    """Writes one answer to `request` on `sock`.

    `date()`: the current `Date` value; `closing()`: True when the connection must close
    after this answer (the server shuts down); `write_timeout_s`: how long a send may go
    without the client taking a byte. `keeps_connection`: once finished, whether the
    connection can carry the next request.
    """

    __slots__ = (
        "_bodyless",
        "_closing",
        "_date",
        "_framing",
        "_http_version",
        "_keep_alive",
        "_remaining",
        "_request",
        "_socket",
        "_started",
        "_write_timeout_s",
        "aborted",
        "ending",
        "finished",
    )

    def __init__(
        self,
        sock: DirectSocket,
        request: Request,
        *,
        http_version: bytes,
        date: Callable[[], bytes],
        closing: Callable[[], bool],
        write_timeout_s: float,
    ) -> None:
        self._socket = sock
        self._request = request
        self._http_version = http_version
        self._date = date
        self._closing = closing
        self._write_timeout_s = write_timeout_s
        self._started = False
        self._bodyless = False
        self._framing = LENGTH
        self._remaining = 0
        self._keep_alive = False
        # `ending`: the last bytes are being sent; `finished`: they were sent.
        self.ending = False
        self.finished = False
        self.aborted = False

    @property
    def started(self) -> bool:
        return self._started

    @property
    def keeps_connection(self) -> bool:
        return self.finished and self._keep_alive

    async def abort(self, *, reset: bool = False) -> None:
        """Drop the connection without finishing the answer; `reset` makes the close a TCP RST.

        The connection is closed when the handler returns; nothing more is sent on it.
        """
        if reset:
            self._socket.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        self.aborted = True
        await trio.lowlevel.checkpoint()

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Send a whole response with a Content-Length (none for 204/304)."""
        head = list(headers)
        if status not in _NO_BODY_STATUSES:
            head.append((b"content-length", b"%d" % len(body)))
        data = self._head(status, head)
        if body and not self._bodyless:
            if self._framing == CHUNKED:
                data += b"%x\r\n%s\r\n" % (len(body), body)
            else:
                if self._framing == LENGTH:
                    self._count(len(body))
                data += body
        self._end_check()
        if self._framing == CHUNKED:
            data += b"0\r\n\r\n"
        self.ending = True
        await self._send(data)
        self.finished = True

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """Send the status line and headers, and the body's `first` bytes in the same
        send; the body follows chunked unless a content-length header was given.
        """
        head = self._head(status, list(headers))
        await self._send(head + self._framed(first) if first else head)

    async def write(self, data: bytes) -> None:
        """Send one body chunk now. Raises ClientDisconnected when the send fails."""
        if not self._started or self.finished:
            raise RuntimeError("write() needs start() first and no finish() yet")
        framed = self._framed(data) if data else b""
        if not framed:
            return
        # A relayed event's path: sent here, not through `_send` (a coroutine fewer per
        # event, `bench --instructions`).
        try:
            await self._socket.send_all(framed, stall_timeout_s=self._write_timeout_s)
        except (SendStalled, trio.BrokenResourceError) as failed:
            raise self._client_gone(failed) from failed

    async def finish(self, last: bytes = b"") -> None:
        """End the body, its `last` bytes and the end in one send."""
        if not self._started or self.finished:
            raise RuntimeError("finish() needs start() first and no finish() yet")
        data = self._framed(last) if last else b""
        self._end_check()
        self.ending = True
        if self._framing == CHUNKED:
            data += b"0\r\n\r\n"
        if data:
            await self._send(data)
        else:
            await trio.lowlevel.checkpoint()
        self.finished = True

    def _framed(self, data: bytes) -> bytes:
        """`data` as the body's framing carries it (b"" when the answer has no body)."""
        if self._bodyless:
            return b""
        if self._framing == CHUNKED:
            return b"%x\r\n%s\r\n" % (len(data), data)
        if self._framing == LENGTH:
            self._count(len(data))
        return data

    def _head(self, status: int, head: list[tuple[bytes, bytes]]) -> bytes:
        if self._started:
            raise RuntimeError("the response was already started")
        has_server = has_date = False
        for name, _ in head:
            lowered = name.lower()
            has_server = has_server or lowered == b"server"
            has_date = has_date or lowered == b"date"
        if not has_server:
            head.append(SERVER_HEADER)
        if not has_date:
            head.append((b"date", self._date()))
        if self._closing():
            head.append(CLOSE_HEADER)
        request = self._request
        # Built before `started` flips: a head refused here leaves room for a 500.
        encoded = encode_head(
            status,
            head,
            _reason(status),
            method=request.method,
            http_version=self._http_version,
            request_keep_alive=request_keeps_alive(self._http_version, request.headers),
        )
        self._started = True
        self._framing = encoded.framing
        self._remaining = encoded.length
        self._keep_alive = encoded.keep_alive
        self._bodyless = status in _NO_BODY_STATUSES or request.method == "HEAD"
        return encoded.data

    def _count(self, size: int) -> None:
        if size > self._remaining:
            raise ResponseError("more body than the declared content-length")
        self._remaining -= size

    def _end_check(self) -> None:
        if self._framing == LENGTH and self._remaining and not self._bodyless:
            raise ResponseError("less body than the declared content-length")

    async def _send(self, data: bytes) -> None:
        """Send `data`; ClientDisconnected when the client left, or took no byte for the
        write timeout (the request then ends as if the client had left)."""
        try:
            await self._socket.send_all(data, stall_timeout_s=self._write_timeout_s)
        except (SendStalled, trio.BrokenResourceError) as failed:
            raise self._client_gone(failed) from failed

    def _client_gone(self, failed: SendStalled | trio.BrokenResourceError) -> ClientDisconnected:
        """What a failed send to the client raises: the request is marked as the client's
        departure (a client that took no byte for the write timeout counts as gone)."""
        self._request.client_gone = True
        if isinstance(failed, SendStalled):
            gone = ClientDisconnected(f"the client stopped reading: {failed}")
        else:
            gone = ClientDisconnected("the client closed the connection")
        # Set, not only `raise ... from`: compiled (setup.py), `from` sets no cause, and the
        # pipeline tells a stalled client from a departed one by it.
        gone.__cause__ = failed
        return gone


@functools.cache
def _reason(status: int) -> bytes:
    """The standard reason phrase (some clients print it)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""

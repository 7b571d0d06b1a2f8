"""The native server's `ResponseWriter`: an answer onto one client connection.

The common whole answer and body chunks are written as bytes built the way h11 builds
them (checked byte for byte by the tests), and h11 is told only what moves its connection
state; anything unusual goes through h11 itself. Split from `router.http.server`, which
owns the connection this writer answers on.
"""

from __future__ import annotations

import functools
import re
import socket
import struct
from http import HTTPStatus
from typing import Protocol

import h11
import trio
from h11._writers import ChunkedWriter

from router.http.direct_socket import DirectSocket, SendStalled
from router.http.messages import ClientDisconnected, Headers, Request
from router.http.server_settings import CLOSE_HEADER, SERVER_HEADER

_NO_BODY_STATUSES = frozenset({204, 304})
# h11's own grammar for header names and values (h11/_abnf.py), so the direct response path
# below accepts exactly what h11 would and hands everything else to h11 to refuse.
_FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
# Headers whose presence changes framing or keep-alive: h11 must see them to decide.
_FRAMING_NAMES = frozenset({b"content-length", b"transfer-encoding", b"connection"})
_END_OF_MESSAGE = h11.EndOfMessage()
# Methods whose answers h11 frames (or switches protocol on) by rules of their own.
_OWN_FRAMING_METHODS = frozenset({"HEAD", "CONNECT"})
_SERVER_LINE = b"%s: %s\r\n" % SERVER_HEADER


class ClientConnection(Protocol):
    """The connection a `ResponseWriter` answers on (the server's, seen from here)."""

    @property
    def socket(self) -> DirectSocket: ...

    @property
    def h11(self) -> h11.Connection: ...

    @property
    def write_timeout_s(self) -> float:
        """How long a send may go without the client taking a byte."""
        ...

    @property
    def closing(self) -> bool:
        """True when the connection closes after this answer (the server shuts down)."""
        ...

    def http_date(self) -> bytes: ...


class ResponseWriter:
    """The native `ResponseWriter`: h11 events straight onto the client socket (for the
    common whole answer and for body chunks, bytes built as h11 builds them, h11 told
    only what moves its state)."""

    __slots__ = (
        "_bodyless",
        "_chunked",
        "_connection",
        "_request",
        "_started",
        "aborted",
        "ending",
        "finished",
    )

    def __init__(self, connection: ClientConnection, request: Request) -> None:
        self._connection = connection
        self._request = request
        self._started = False
        self._bodyless = False
        self._chunked = False
        # `ending`: the last bytes are being sent; `finished`: they were sent.
        self.ending = False
        self.finished = False
        self.aborted = False

    @property
    def started(self) -> bool:
        return self._started

    async def abort(self, *, reset: bool = False) -> None:
        """Drop the connection without finishing the answer; `reset` makes the close a TCP RST.

        The connection is closed when the handler returns; nothing more is sent on it.
        """
        if reset:
            self._connection.socket.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        self.aborted = True
        await trio.lowlevel.checkpoint()

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Send a whole response with a Content-Length (none for 204/304)."""
        data = self._direct_response(status, headers, body)
        if data is None:
            data = self._h11_response(status, headers, body)
        self.ending = True
        await self._send(data)
        self.finished = True

    def _direct_response(self, status: int, headers: Headers, body: bytes) -> bytes | None:
        """The whole response's bytes built here, h11 told only the events' effect on its
        state; None when h11 must build it (anything but a keep-alive HTTP/1.1 exchange
        with a content-length body and plain headers, on a method other than HEAD or
        CONNECT).

        The bytes are those h11 would write: the same status line, the headers in the order
        given, then `content-length`, then `server` / `date` when missing; each
        handler header matched against h11's grammar first, and any framing header
        (content-length, transfer-encoding, connection) left to h11.
        """
        connection = self._connection
        conn = connection.h11
        if (
            self._started
            or conn.our_state is not h11.SEND_RESPONSE
            or conn.their_http_version != b"1.1"
            or not conn._cstate.keep_alive
            or connection.closing
            or self._request.method in _OWN_FRAMING_METHODS
            or status in _NO_BODY_STATUSES
            or not 200 <= status < 600
        ):
            return None
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
        has_server = has_date = False
        for name, value in headers:
            if (
                type(name) is not bytes
                or type(value) is not bytes
                or _FIELD_NAME.fullmatch(name) is None
                or _FIELD_VALUE.fullmatch(value) is None
            ):
                return None
            lowered = name.lower()
            if lowered in _FRAMING_NAMES:
                return None
            has_server = has_server or lowered == b"server"
            has_date = has_date or lowered == b"date"
            parts.append(b"%s: %s\r\n" % (name, value))
        length = b"%d" % len(body)
        parts.append(b"content-length: %s\r\n" % length)
        if not has_server:
            parts.append(_SERVER_LINE)
        if not has_date:
            parts.append(b"date: %s\r\n" % connection.http_date())
        parts.append(b"\r\n")
        parts.append(body)
        # What `send` would do minus building and checking the bytes again: the events
        # move h11's state exactly as if they had been sent. Of the headers only those
        # h11 reads for that go in: the framing (content-length); keep-alive and protocol
        # switches hang on headers that are never on this path.
        response = h11.Response(
            status_code=status,
            headers=[(b"content-length", length)],
            reason=_reason(status),
            _parsed=True,
        )
        conn._process_event(h11.SERVER, response)
        conn._process_event(h11.SERVER, _END_OF_MESSAGE)
        self._started = True
        return b"".join(parts)

    def _h11_response(self, status: int, headers: Headers, body: bytes) -> bytes:
        head = list(headers)
        if status not in _NO_BODY_STATUSES:
            head.append((b"content-length", b"%d" % len(body)))
        conn = self._connection.h11
        data = conn.send(self._response(status, head))
        if body and not self._bodyless:
            data = b"".join((data, conn.send(h11.Data(data=body)), conn.send(h11.EndOfMessage())))
        else:
            data += conn.send(h11.EndOfMessage())
        return data

    async def start(self, status: int, headers: Headers) -> None:
        """Send the status line and headers; the body follows chunked unless a
        content-length header was given.
        """
        conn = self._connection.h11
        data = conn.send(self._response(status, list(headers)))
        # Under chunked framing h11 keeps no state per body chunk, so `write` frames the
        # chunks itself; any other framing (a content-length to count) stays with h11.
        self._chunked = type(conn._writer) is ChunkedWriter
        await self._send(data)

    async def write(self, data: bytes) -> None:
        """Send one body chunk now. Raises ClientDisconnected when the send fails."""
        if not self._started or self.finished:
            raise RuntimeError("write() needs start() first and no finish() yet")
        if data and not self._bodyless:
            if self._chunked:
                await self._send(b"%x\r\n%s\r\n" % (len(data), data))
            else:
                await self._send(self._connection.h11.send(h11.Data(data=data)))

    async def finish(self) -> None:
        if not self._started or self.finished:
            raise RuntimeError("finish() needs start() first and no finish() yet")
        data = self._connection.h11.send(h11.EndOfMessage())
        self.ending = True
        await self._send(data)
        self.finished = True

    def _response(self, status: int, head: list[tuple[bytes, bytes]]) -> h11.Response:
        if self._started:
            raise RuntimeError("the response was already started")
        connection = self._connection
        has_server = has_date = False
        for name, _ in head:
            lowered = name.lower()
            has_server = has_server or lowered == b"server"
            has_date = has_date or lowered == b"date"
        if not has_server:
            head.append(SERVER_HEADER)
        if not has_date:
            head.append((b"date", connection.http_date()))
        if connection.closing:
            head.append(CLOSE_HEADER)
        # Built before `started` flips: a header h11 rejects leaves room for a 500.
        response = h11.Response(status_code=status, headers=head, reason=_reason(status))
        self._started = True
        self._bodyless = status in _NO_BODY_STATUSES or self._request.method == "HEAD"
        return response

    async def _send(self, data: bytes) -> None:
        """Send `data`; ClientDisconnected when the client left, or took no byte for the
        write timeout (the request then ends as if the client had left)."""
        connection = self._connection
        try:
            await connection.socket.send_all(data, stall_timeout_s=connection.write_timeout_s)
        except SendStalled as exc:
            self._request.client_gone = True
            raise ClientDisconnected(f"the client stopped reading: {exc}") from exc
        except trio.BrokenResourceError as exc:
            self._request.client_gone = True
            raise ClientDisconnected("the client closed the connection") from exc


@functools.cache
def _reason(status: int) -> bytes:
    """The standard reason phrase (some clients print it; h11 sends none by default)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""

"""Limits of the native HTTP/1.1 server (`router.http.server.loop`) and the fixed answers it
gives a client that crosses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from email.utils import formatdate
from typing import Final

from router.http.server.exceptions import HeadTooLarge, MalformedRequest, Refusal, RefusalAnswer
from router.http.server.request_parser import ParseError


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where the server listens and how much it accepts from a client.

    - `max_header_bytes`: the request line plus headers, as bytes;
      over it the client gets 431 and the connection is closed.
    - `max_body_bytes`: over it 413; a declared Content-Length over the limit is refused
      before any body byte is read, a chunked body as soon as its running total passes it.
    - `max_connections`: connections beyond it are accepted, answered 503 with
      `Retry-After: 1` without reading their request, and closed. Refusing at once tells the
      client the truth; leaving them in the kernel backlog would look like a hang.
    - `header_timeout_s`: a request line and headers (first request: counted from accept;
      later ones: from their first byte) must arrive within it, else 408 and close.
    - `body_timeout_s`: the whole request body must arrive within it, counted from the end
      of the head, else 408 and close (a byte now and then does not keep a connection).
    - `client_write_timeout_s`: a send to the client that makes no progress (the client
      stopped reading) for this long ends the request as if the client had left: the
      handler is told `ClientDisconnected`, the connection closes.
    - `max_buffered_body_bytes`: request-body bytes buffered at once across all
      connections (`ServerLoad`); a body that would go beyond: 503 with `Retry-After`,
      connection closed, the handler never runs.
    - `idle_timeout_s`: a keep-alive connection with no byte of a next request is closed
      silently after it.
    - `shutdown_grace_s`: after shutdown begins, in-flight requests get this long to finish.
    - `reuse_port`: listen with SO_REUSEPORT, so several processes share the port.
    """

    host: str = "127.0.0.1"
    port: int = 0
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 10_000
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 75.0
    shutdown_grace_s: float = 30.0
    reuse_port: bool = False
    body_timeout_s: float = 30.0
    client_write_timeout_s: float = 60.0
    max_buffered_body_bytes: int = 1024**3


SERVER_HEADER: Final = (b"server", b"trio-router")
CLOSE_HEADER: Final = (b"connection", b"close")


def protocol_error(exc: ParseError, settings: ServerSettings) -> Refusal:
    """The answer to a request that could not be parsed: 431 for an oversize head, else 400
    (a Transfer-Encoding other than a lone `chunked` included, RFC 9112 section 6.3: the
    body's end cannot be found, so the connection closes and nothing behind the request is
    read as a request).
    """
    if exc.status_hint == 431:
        return HeadTooLarge(f"request headers exceed {settings.max_header_bytes} bytes")
    return MalformedRequest(f"malformed HTTP request: {exc}")


def encode_refusal(answer: RefusalAnswer, date: bytes, *, bodyless: bool = False) -> bytes:
    """A complete answer to a refused request that also tells the client the connection
    closes.

    `bodyless`: the answer to a HEAD request, its headers only (its length all the same).
    """
    status, headers, body = answer
    head = [
        *headers,
        (b"content-length", b"%d" % len(body)),
        CLOSE_HEADER,
        SERVER_HEADER,
        (b"date", date),
    ]
    lines = b"".join(b"%s: %s\r\n" % (name, value) for name, value in head)
    status_line = b"HTTP/1.1 %d \r\n" % status
    return b"".join((status_line, lines, b"\r\n", b"" if bodyless else body))


class HttpDate:
    """The HTTP `Date` value, formatted at most once a second.

    Wall-clock time on purpose: the header names a calendar instant, not a deadline.
    """

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def now(self) -> bytes:
        second = int(time.time())  # wall-clock: the Date header names the calendar second
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True).encode("ascii")
        return self._value

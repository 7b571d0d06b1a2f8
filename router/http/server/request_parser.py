"""One request off a client connection's bytes, parsed by llhttp (`httptools`), framed by us.

llhttp parses; this module decides where the request ends and hands llhttp exactly its
bytes: the head up to its first empty line (llhttp takes no line end but CRLF, so that is
the head's end for both), then `Content-Length` bytes, or the chunked body up to where
`ChunkedFraming` (which follows the raw bytes and refuses what RFC 9112 does not allow)
says it ends. Whatever follows is the next request's, left in `trailing_data`. Two parsers
that disagree on where a request ends are a smuggled request: llhttp not done when our
framing is, or done before, is refused 400.

What llhttp lets through and this module (with `check_framing`) refuses, found by feeding
it each case: a Transfer-Encoding other than one lone `chunked` (llhttp takes
`gzip, chunked`), Transfer-Encoding on HTTP/1.0, a version other than 1.0 and 1.1 (llhttp
takes `GET /` as HTTP/0.9, and `HTTP/2.0`), an HTTP/1.1 request without exactly one
`Host`. What llhttp refuses itself: both Content-Length and Transfer-Encoding, two
Content-Length fields, a malformed chunk size or extension, obs-fold, NUL, CR or a control
byte in a header, a bare LF as a line end, a method it does not know.

Pure and synchronous: `receive_data` takes bytes (b"" for end-of-stream), `next_event`
returns what is complete. Raises `ParseError` (with a status hint: 431 for a head over
the limit, else 400), `FramingError` (400) or `BodyTooLarge` (413).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import httptools

from router.http.server.chunked_framing import ChunkedFraming
from router.http.server.request_framing import FramingError, check_framing

__all__ = ["END", "NEED_DATA", "ParseError", "RequestHead", "RequestParser"]


class _Signal:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = _Signal("NEED_DATA")
"""More bytes are needed for the next event."""
END: Final = _Signal("END")
"""The request's body is complete."""
CLOSED: Final = _Signal("CLOSED")
"""The client closed the connection before a byte of another request."""

_HEAD_STATE: Final = 0
_BODY_STATE: Final = 1
_END_STATE: Final = 2
_DONE_STATE: Final = 3
_VERSIONS: Final = {"1.1": b"1.1", "1.0": b"1.0"}


class ParseError(Exception):
    """Bytes that are no HTTP/1.1 request; `status_hint`: 431 for a head over the limit."""

    def __init__(self, message: str, status_hint: int = 400) -> None:
        super().__init__(message)
        self.status_hint = status_hint


@dataclass(slots=True, init=False)
class RequestHead:
    """A request line and its headers (names lower-case, values without edge whitespace)."""

    method: bytes
    target: bytes
    http_version: bytes
    headers: list[tuple[bytes, bytes]]
    content_length: int
    chunked: bool
    expects_continue: bool

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        method: bytes,
        target: bytes,
        http_version: bytes,
        headers: list[tuple[bytes, bytes]],
        content_length: int,
        chunked: bool,
        expects_continue: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.http_version = http_version
        self.headers = headers
        self.content_length = content_length
        self.chunked = chunked
        self.expects_continue = expects_continue


class _Events:
    """What llhttp reports for one request (the callbacks it calls)."""

    __slots__ = ("body", "complete", "headers", "url")

    def __init__(self) -> None:
        self.url = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class RequestParser:
    """Parses one request; what the bytes hold past it is `trailing_data`."""

    __slots__ = (
        "_buffer",
        "_chunked",
        "_closed",
        "_events",
        "_max_body_bytes",
        "_max_head_bytes",
        "_parser",
        "_raw_body",
        "_remaining",
        "_state",
    )

    def __init__(self, max_head_bytes: int, max_body_bytes: int) -> None:
        self._max_head_bytes = max_head_bytes
        self._max_body_bytes = max_body_bytes
        self._buffer = bytearray()
        self._closed = False
        self._state = _HEAD_STATE
        self._events = _Events()
        self._parser = httptools.HttpRequestParser(self._events)
        self._chunked: ChunkedFraming | None = None
        self._remaining = 0
        # llhttp ends an upgrade request (and CONNECT) at its head, leaving what follows to
        # the other protocol; the router switches to none, so a declared body is taken here.
        self._raw_body = False

    @property
    def method(self) -> bytes | None:
        """The request's method once its request line is in (a refusal of a HEAD request
        has no body), else None."""
        return self._parser.get_method() if self._events.url else None

    @property
    def buffered(self) -> bool:
        """True when bytes of a request are already here (a pipelined one)."""
        return bool(self._buffer)

    @property
    def trailing_data(self) -> tuple[bytes, bool]:
        """The bytes not parsed (past the request, once it is complete), and whether the
        client closed its side."""
        return bytes(self._buffer), self._closed

    def receive_data(self, data: bytes) -> None:
        if data:
            self._buffer += data
        else:
            self._closed = True

    def next_event(self) -> RequestHead | bytes | _Signal:
        """The head, then body bytes (as they arrive), then END; NEED_DATA in between;
        CLOSED for a connection that ended before a request."""
        state = self._state
        if state == _HEAD_STATE:
            return self._next_head()
        if state == _BODY_STATE:
            return self._next_body()
        if state == _END_STATE:
            self._state = _DONE_STATE
            return END
        raise RuntimeError("the request was already parsed")

    def _next_head(self) -> RequestHead | _Signal:
        buffer = self._buffer
        # Empty lines before a request line are skipped (RFC 9112 section 2.2).
        start = len(buffer) - len(buffer.lstrip(b"\r\n"))
        end = buffer.find(b"\r\n\r\n", start)
        if end < 0 or end + 4 - start > self._max_head_bytes:
            if len(buffer) - start > self._max_head_bytes:
                raise ParseError(f"request head over {self._max_head_bytes} bytes", 431)
            if self._closed:
                if start == len(buffer):
                    return CLOSED
                raise ParseError("the client closed the connection within a request head")
            if buffer.count(b"\n", start) != buffer.count(b"\r\n", start):
                # A line ended by a bare LF: llhttp takes none, and no CRLF CRLF may follow.
                raise ParseError("a request line or header line ended by a bare LF")
            return NEED_DATA
        raw = bytes(buffer[: end + 4])
        del buffer[: end + 4]
        events = self._events
        self._raw_body = self._feed(raw)
        version = _VERSIONS.get(self._parser.get_http_version())
        if version is None:
            raise ParseError(f"HTTP version {self._parser.get_http_version()} not supported")
        headers = events.headers
        _, chunked = check_framing(headers, version, raw[start:])
        length = 0
        hosts = 0
        expects_continue = False
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            elif name == b"host":
                hosts += 1
            elif name == b"expect":
                expects_continue = value.lower() == b"100-continue"
        if version == b"1.1" and hosts != 1:
            raise ParseError("an HTTP/1.1 request needs exactly one Host header")
        head = RequestHead(
            method=self._parser.get_method(),
            target=bytes(events.url),
            http_version=version,
            headers=headers,
            content_length=length,
            chunked=chunked,
            expects_continue=expects_continue and version == b"1.1",
        )
        if chunked and self._raw_body:
            raise FramingError("an upgrade request with a chunked body")
        if chunked:
            self._chunked = ChunkedFraming(self._max_body_bytes)
            self._state = _BODY_STATE
        elif length:
            self._remaining = length
            self._state = _BODY_STATE
        else:
            self._finish()
        return head

    def _next_body(self) -> bytes | _Signal:
        buffer = self._buffer
        if not buffer:
            if self._closed:
                raise ParseError("the client closed the connection within a request body")
            return NEED_DATA
        chunked = self._chunked
        if chunked is not None:
            taken = chunked.feed(buffer)
            done = chunked.done
        else:
            taken = min(self._remaining, len(buffer))
            self._remaining -= taken
            done = self._remaining == 0
        piece = bytes(buffer[:taken])
        del buffer[:taken]
        if self._raw_body:
            if done:
                self._state = _END_STATE
            return piece
        events = self._events
        self._feed(piece)
        data = b"".join(events.body)
        events.body.clear()
        if done:
            self._finish()
        elif events.complete:
            raise FramingError("the request's body ends where its framing says it does not")
        return data

    def _finish(self) -> None:
        if not self._events.complete:
            raise FramingError("the request's body does not end where its framing says")
        self._state = _END_STATE

    def _feed(self, data: bytes) -> bool:
        """Hand llhttp `data`; True when it ended the request there as an upgrade."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # llhttp hands the connection over at this offset: it must be the end of what
            # it was given, all of which is the request's.
            if upgrade.args[0] != len(data) or not self._events.complete:
                raise FramingError("an upgrade request with bytes after its end") from None
            return True
        except httptools.HttpParserError as exc:
            raise ParseError(str(exc) or type(exc).__name__) from None
        return False

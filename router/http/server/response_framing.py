"""An answer's head and body framing, decided and written by the server itself.

Pure and synchronous. `encode_head` checks the handler's headers against HTTP/1.1's
grammar (RFC 9110 section 5: a token for the name, no NUL, CR, LF or edge whitespace in
the value), decides how the body is framed (RFC 9112 section 6.3) and whether the
connection stays open, and writes the head's bytes. The rules and the bytes are those h11
(the reference the tests compare against, byte for byte) writes for the same exchange:
- no body for 204, 304, HEAD and a 2xx to CONNECT (a HEAD answer keeps the head a GET
  would get);
- `Transfer-Encoding: chunked` wins over `Content-Length`; a head with neither is sent
  chunked to an HTTP/1.1 client and delimited by the connection's close to an HTTP/1.0 one;
- the connection closes after the answer when the request or the answer says
  `Connection: close`, when the client speaks HTTP/1.0, or when the server is closing;
  the head then says `Connection: close`.
A head that breaks the grammar, or declares conflicting lengths, raises `ResponseError`
before any byte is sent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from router.http.field_names import lowered_field_name
from router.http.server.messages import Headers

__all__ = ["CHUNKED", "LENGTH", "UNTIL_CLOSE", "ResponseError", "ResponseHead", "encode_head"]

_FIELD_VALUE: Final = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
_DIGITS: Final = re.compile(rb"[0-9]+")
_MAX_LENGTH_DIGITS: Final = 20
_NO_BODY_STATUSES: Final = frozenset({204, 304})
_FRAMING_NAMES: Final = frozenset({b"content-length", b"transfer-encoding", b"connection", b"host"})
"""Names whose value decides the framing or the order of the head: never taken as a line
checked before, always read."""
_LENGTH_NAMES: Final = frozenset({b"content-length", b"transfer-encoding"})
KNOWN_LINES: Final = 1024
KNOWN_LINE_BYTES: Final = 256
_known_lines: Final[dict[tuple[bytes, bytes], tuple[bytes, bytes]]] = {}
"""Header lines already checked, by their name and value as given: an answer carries
mostly the lines the last one did (its content type, the worker, the server, the date).
At most `KNOWN_LINES` of at most `KNOWN_LINE_BYTES` bytes; cleared when full."""

# How a body is framed on the wire.
LENGTH: Final = 0
CHUNKED: Final = 1
UNTIL_CLOSE: Final = 2


class ResponseError(Exception):
    """An answer HTTP/1.1 cannot carry as the handler asked (a bad header, a wrong length)."""


@dataclass(slots=True, init=False)
class ResponseHead:
    """A head's bytes and what they commit the body and the connection to.

    `length`: the body's byte count under LENGTH framing (0 for an answer without a body).
    """

    data: bytes
    framing: int
    length: int
    keep_alive: bool

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(self, data: bytes, framing: int, length: int, keep_alive: bool) -> None:
        self.data = data
        self.framing = framing
        self.length = length
        self.keep_alive = keep_alive


LenientHeaders = Sequence[tuple[bytes | str, bytes | str]]
"""What `encode_head` takes: `Headers`, or header text as str (ASCII), which it encodes.
Typed so, not as `Headers`, so that the compiled build (setup.py), which checks a value
against its declared type, takes the text too."""


def encode_head(
    status: int,
    headers: LenientHeaders,
    reason: bytes,
    *,
    method: str,
    http_version: bytes,
    request_keep_alive: bool,
) -> ResponseHead:
    """The head for `status` and `headers` (in the order given), to a request made with
    `method` over `http_version`; `request_keep_alive`: False when the request (or the
    server, closing) already ended the connection's reuse."""
    if not 200 <= status < 1000:
        raise ResponseError(f"a final response needs a status from 200 to 999, not {status}")
    # (lowered name, the line's bytes) per header, in order.
    lines: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    chunked = False
    has_host = False
    connection: list[bytes] = []
    known = _known_lines
    for raw_name, raw_value in headers:
        line = (
            known.get((raw_name, raw_value))
            if type(raw_name) is bytes and type(raw_value) is bytes
            else None
        )
        if line is None:
            line = _checked_line(raw_name, raw_value)
        name = line[0]
        if name in _FRAMING_NAMES:
            value = _bytes(raw_value)
            if name == b"content-length":
                lengths = {part.strip() for part in value.split(b",")}
                if len(lengths) != 1:
                    raise ResponseError("conflicting content-length headers")
                value = lengths.pop()
                if _DIGITS.fullmatch(value) is None or len(value) > _MAX_LENGTH_DIGITS:
                    raise ResponseError(f"bad content-length {value!r}")
                if length is not None:
                    if length != value:
                        raise ResponseError("conflicting content-length headers")
                    continue
                length = value
                line = (name, b"%s: %s\r\n" % (_bytes(raw_name), value))
            elif name == b"transfer-encoding":
                if chunked:
                    raise ResponseError("more than one transfer-encoding header")
                value = value.lower()
                if value != b"chunked":
                    raise ResponseError("transfer-encoding other than chunked")
                chunked = True
                line = (name, b"%s: %s\r\n" % (_bytes(raw_name), value))
            elif name == b"connection":
                connection.extend(_comma_values(value))
            else:
                has_host = True
        lines.append(line)

    # A 2xx to CONNECT turns the connection into a tunnel: no body, and no HTTP after it.
    tunnel = method == "CONNECT" and 200 <= status < 300
    fixed_empty = tunnel or status in _NO_BODY_STATUSES
    need_close = False
    if not fixed_empty and (chunked or length is None):
        # A body of unknown length: chunked to an HTTP/1.1 client, else ended by the close.
        lines = [line for line in lines if line[0] not in _LENGTH_NAMES]
        length = None
        if http_version == b"1.1":
            lines.append((b"transfer-encoding", b"Transfer-Encoding: chunked\r\n"))
            chunked = True
        else:
            chunked = False
            need_close = method != "HEAD"
    if not request_keep_alive or need_close:
        tokens = set(connection)
        tokens.discard(b"keep-alive")
        tokens.add(b"close")
        lines = [line for line in lines if line[0] != b"connection"]
        connection = sorted(tokens)
        lines.extend((b"connection", b"Connection: %s\r\n" % token) for token in connection)

    if fixed_empty or method == "HEAD":
        framing, body_length = LENGTH, 0
    elif chunked:
        framing, body_length = CHUNKED, 0
    elif length is not None:
        framing, body_length = LENGTH, int(length)
    else:
        framing, body_length = UNTIL_CLOSE, 0
    keep_alive = (
        not tunnel
        and request_keep_alive
        and not need_close
        and framing != UNTIL_CLOSE
        and b"close" not in connection
    )
    if has_host:
        # Host first, as h11 writes it (an answer rarely has one).
        lines = [line for line in lines if line[0] == b"host"] + [
            line for line in lines if line[0] != b"host"
        ]
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    parts += [line for _, line in lines]
    parts.append(b"\r\n")
    return ResponseHead(b"".join(parts), framing, body_length, keep_alive)


def _checked_line(raw_name: bytes | str, raw_value: bytes | str) -> tuple[bytes, bytes]:
    """The lowered name and the line's bytes of one header, its name and value checked;
    remembered when both came as bytes (`_known_lines`)."""
    name_bytes = _bytes(raw_name)
    value = _bytes(raw_value)
    name = lowered_field_name(name_bytes)
    if name is None:
        raise ResponseError(f"illegal header name {name_bytes!r}")
    if _FIELD_VALUE.fullmatch(value) is None:
        raise ResponseError(f"illegal header value {value!r}")
    line = (name, b"%s: %s\r\n" % (name_bytes, value))
    if type(raw_name) is bytes and type(raw_value) is bytes and len(line[1]) <= KNOWN_LINE_BYTES:
        if len(_known_lines) >= KNOWN_LINES:
            # Ever new values (request ids) fill it: start again, and the lines every answer
            # carries are learnt again by the next answers.
            _known_lines.clear()
        _known_lines[(raw_name, raw_value)] = line
    return line


def request_keeps_alive(http_version: bytes, headers: Headers) -> bool:
    """Whether a request lets its connection be reused: HTTP/1.1 without `Connection: close`."""
    if http_version != b"1.1":
        return False
    for name, value in headers:
        if name == b"connection" and b"close" in _comma_values(value):
            return False
    return True


def _comma_values(value: bytes) -> list[bytes]:
    return [part for part in (piece.strip() for piece in value.lower().split(b",")) if part]


def _bytes(value: bytes | str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        try:
            return value.encode("ascii")
        except UnicodeEncodeError:
            raise ResponseError(f"header text must be ASCII: {value!r}") from None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise ResponseError(f"a header must be bytes, not {type(value).__name__}")

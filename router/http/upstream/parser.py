"""A worker's response parsed by llhttp (`httptools`), behind checks of our own.

The upstream connection finds where a head ends (its first CRLF CRLF, bounded) and
decides the body's framing from the headers (RFC 9112 section 6.3); llhttp parses the
head's lines and decodes a chunked body, fed the bytes that follow the head as they
arrive. A body framed by a length or by the end of the connection never reaches it:
counting bytes is cheaper than any parser. One `UpstreamParser` serves one response (a
1xx head included), because llhttp cannot be told that a response to HEAD has no body,
nor be handed a body it was not fed.

What llhttp lets through and this module refuses, found by feeding it each case: a
version other than HTTP/1.1 and HTTP/1.0 (llhttp takes 0.9 and 2.0), a status outside
100-599 (llhttp takes 000-999), a control byte, DEL or NUL in the reason phrase. What
llhttp refuses itself: a header name that is no token or a space before its colon, a
control byte, DEL or a bare CR in a value, obs-fold, a bare LF as a line end; in a
chunked body a size that is not hex
or over 64 bits, an extension that is not `;name[=value]` (a space after the `;`
included), chunk data not followed by CRLF, a malformed trailer line, a content-length in
the trailer.

Where llhttp is stricter than the worker edge means to be: it refuses a content-length
sent twice, even with one value (two equal fields, or `5, 5`, which a proxy beside a
worker may produce: RFC 9110 section 8.6 lets a recipient take it), and content-length
beside transfer-encoding on a 204, 304 or HEAD response, which has no body whatever it
says. A head llhttp refuses that holds content-length fields is parsed again without
them (each checked to be a field value), and the connection's framing logic judges
their values as it always did: digits, one value however often repeated, and only where
a body is framed by them. llhttp also refuses spaces between a chunk size and its
extension or line end; those are let through (`lenient_spaces_after_chunk_size`), as
RFC 9112's BWS before an extension and our parser before it allowed (h11 takes them only
before the line end). A chunk size with leading zeros is taken (llhttp refuses only one over 64
bits): only the router reads a worker's chunked framing, so no second parser can read it
differently.

llhttp must decode a body we frame as chunked: one `transfer-encoding: chunked` field is
what both take as chunked, except `chunked` followed by a tab, which llhttp reads as a body
that runs until the connection ends. The first read of the body tells (a size line is
never data), and such a body is refused.

Bytes beyond the response's end: llhttp goes on to parse them as a next message. Its
start (`on_message_begin`), or an error, after the end marks them; CR and LF, which llhttp
skips between messages without a word, are caught at the end of what was fed: a chunked
message ends with a byte other than CR or LF and then CRLF CRLF, so a longer run of CR and
LF bytes at the end means bytes beyond it.
"""

from __future__ import annotations

import re
from typing import Final

import httptools

from router.http.upstream.exceptions import UpstreamProtocolError

__all__ = ["UpstreamParser", "header_tokens"]

# HTAB, SP, visible ASCII and obs-text: what a reason phrase (RFC 9112 section 4) and a
# field value (RFC 9110 section 5.5) are made of. A bare CR in a reason is not a character
# but a way to hide a second status line from one parser of two.
_TEXT: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
# Chunk lines, extensions and trailers that carry no body byte: llhttp reads them without
# buffering, so the bound is on the worker's CPU use of ours, not on memory.
_MAX_FRAMING_WITHOUT_DATA: Final = 65536
_CR_LF: Final = (13, 10)


class _Events:
    """What llhttp reports for one response (the callbacks it calls)."""

    __slots__ = ("beyond", "body", "complete", "head_read", "headers")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False
        self.beyond = False
        self.head_read = False
        """Set once the head is taken: the fields llhttp reports after it (trailers, and
        the head of a message beyond the end) go nowhere. The relay has no use for them,
        and a worker could otherwise make us hold a tuple per few bytes it sends."""

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_read:
            return
        # llhttp strips a value's leading whitespace but keeps its trailing whitespace.
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body.append(body)

    def on_message_begin(self) -> None:
        if self.complete:
            self.beyond = True

    def on_message_complete(self) -> None:
        self.complete = True


class UpstreamParser:
    """One response's head, then its chunked body if it has one.

    `complete`: llhttp saw the chunked body's end. `beyond`: bytes followed that end.
    """

    __slots__ = ("_events", "_fed", "_parser", "_tail", "_without_data")

    def __init__(self) -> None:
        self._events = _Events()
        self._parser = httptools.HttpResponseParser(self._events)
        # The last bytes fed, to judge the end of the message when it comes in a short read.
        self._tail = b""
        self._without_data = 0
        self._fed = False

    @property
    def complete(self) -> bool:
        return self._events.complete

    @property
    def beyond(self) -> bool:
        return self._events.beyond

    def parse_head(self, head: bytes) -> tuple[int, list[tuple[bytes, bytes]], bool]:
        """The status, the headers (names lower-case, values without edge whitespace) and
        whether the version allows keep-alive. `head` ends with its CRLF CRLF.

        Raises `UpstreamProtocolError` (response started) for anything that is no HTTP/1.x
        response head.
        """
        status_line = head[: head.find(b"\r\n")]
        version = status_line[:9]
        if version == b"HTTP/1.1 ":
            keep_alive = True
        elif version == b"HTTP/1.0 ":
            keep_alive = False
        else:
            raise UpstreamProtocolError(
                f"upstream sent no HTTP/1.1 status line: {status_line[:40]!r}",
                response_started=True,
            )
        code = status_line[9:12]
        if (
            len(code) != 3
            or not code.isdigit()
            or not b"100" <= code <= b"599"
            or (len(status_line) > 12 and status_line[12] != 32)
            or _TEXT.fullmatch(status_line, 13) is None
        ):
            # A status outside 100-599 (`000` included) is no HTTP answer: RFC 9110 section 15.
            raise UpstreamProtocolError(
                f"upstream sent a malformed status line: {status_line[:40]!r}",
                response_started=True,
            )
        events = self._events
        try:
            self._parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            # llhttp hands a 101's connection over at its head, every header read: the
            # caller refuses a 101. No other status makes it do so.
            if code != b"101":
                raise UpstreamProtocolError(
                    "upstream response head handed the connection over", response_started=True
                ) from None
        except httptools.HttpParserError as exc:
            events = self._parse_without_content_lengths(head, exc)
        # Trailers come through the same callback: they must not join the head's headers.
        events.head_read = True
        return int(code), events.headers, keep_alive

    def _parse_without_content_lengths(self, head: bytes, error: Exception) -> _Events:
        """Parses `head` again with a fresh llhttp that is not shown its content-length
        fields, which are put back in their places among the headers; raises
        `UpstreamProtocolError` when it has none or llhttp still refuses it."""
        lengths = _content_lengths(head)
        if lengths is not None:
            self._events = events = _Events()
            self._parser = httptools.HttpResponseParser(events)
            try:
                self._parser.feed_data(lengths[0])
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as again:
                # An upgrade here is a 101, which the caller would refuse all the same.
                error = again
            else:
                for index, field in lengths[1]:
                    events.headers.insert(index, field)
                return events
        raise UpstreamProtocolError(
            f"upstream sent a malformed response head: {error}", response_started=True
        ) from None

    def expect_chunked(self) -> None:
        """The head said `transfer-encoding: chunked` and the body follows."""
        self._parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)

    def feed_chunked(self, data: bytes) -> bytes:
        """Decodes the next received bytes of a chunked body; returns its data bytes.

        After `complete`, bytes beyond the end set `beyond` and are dropped. Raises
        `UpstreamProtocolError` (response started) on malformed framing, and past
        `_MAX_FRAMING_WITHOUT_DATA` bytes of framing without a data byte.
        """
        events = self._events
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not events.complete:
                raise UpstreamProtocolError(
                    f"upstream sent a malformed chunked body: {exc}", response_started=True
                ) from None
            events.beyond = True
        tail = data if len(data) >= 5 else self._tail + data
        if events.complete and not events.beyond:
            if not tail.endswith(b"\r\n\r\n") or len(tail) < 5 or tail[-5] in _CR_LF:
                events.beyond = True
        else:
            self._tail = tail[-4:]
        pieces = events.body
        if not self._fed:
            self._fed = True
            # llhttp must decode the chunks too. A transfer-encoding it does not take for
            # `chunked` (one followed by a tab, say) makes it read until the connection
            # ends, handing every byte over as data; a chunked body starts with a size
            # line, which is never data, so a first read handed over whole means that.
            if sum(map(len, pieces)) == len(data):
                raise UpstreamProtocolError(
                    "upstream chunked body not read as chunked by llhttp", response_started=True
                )
        if not pieces:
            if not events.complete:
                self._without_data += len(data)
                if self._without_data > _MAX_FRAMING_WITHOUT_DATA:
                    raise UpstreamProtocolError(
                        f"upstream sent over {_MAX_FRAMING_WITHOUT_DATA} bytes of chunked "
                        "framing without data",
                        response_started=True,
                    )
            return b""
        self._without_data = 0
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        return body


def _content_lengths(head: bytes) -> tuple[bytes, list[tuple[int, tuple[bytes, bytes]]]] | None:
    """The head without its content-length lines, and those fields with their places among
    the head's fields; None when it has none or one whose value is no field value."""
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]]
    lengths = []
    for index, line in enumerate(lines[1:]):
        if line[:15].lower() == b"content-length:":
            value = line[15:].strip(b" \t")
            if _TEXT.fullmatch(value) is None:
                return None
            lengths.append((index, (b"content-length", value)))
        else:
            kept.append(line)
    if not lengths:
        return None
    return b"\r\n".join(kept) + b"\r\n\r\n", lengths


def header_tokens(value: bytes) -> list[bytes]:
    return [token.strip() for token in value.lower().split(b",")]

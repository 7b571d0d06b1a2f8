"""A strict check of a chunked request body, over the raw bytes the request parser decodes.

Parsers differ on chunk sizes (h11 0.16 takes up to 20 hex digits) and on chunk
extensions (h11 discards them unread). A front proxy that reads either differently frames
the body differently, and a request can be smuggled in the difference. `ChunkedFraming`
follows the body's framing next to the parser (`router.http.server.request_parser`, which hands
the parser only the bytes this says belong to the body) and
refuses what RFC 9112 section 7.1 does not allow: a size over 16 hex digits, an
extension that is not `;name` or `;name=value` (token or quoted string), a CR or NUL in a
chunk or trailer line, a folded trailer line, a chunk not followed by CRLF, a chunk line
over `_MAX_LINE_BYTES`. A chunk larger than the body limit is refused at its size line.
Pure and synchronous; the request reader feeds it every byte of the body as it arrives.
"""

from __future__ import annotations

import re
from typing import Final

from router.http.server.exceptions import BodyTooLarge
from router.http.server.request_framing import FramingError

__all__ = ["ChunkedFraming"]

_MAX_LINE_BYTES: Final = 4096
_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_QUOTED: Final = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_CHUNK_LINE: Final = re.compile(
    rb"([0-9A-Fa-f]{1,16})((?:[ \t]*;[ \t]*%s(?:[ \t]*=[ \t]*(?:%s|%s))?)*)[ \t]*"
    % (_TOKEN, _TOKEN, _QUOTED)
)

_SIZE: Final = 0
_DATA: Final = 1
_DATA_END: Final = 2
_TRAILER: Final = 3
_DONE: Final = 4


class ChunkedFraming:
    """Follows one chunked body; `feed` raises FramingError (400) or BodyTooLarge (413).

    Bytes after the body's end (a pipelined request) are left alone.
    """

    __slots__ = ("_limit", "_line", "_remaining", "_state")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._state = _SIZE
        self._line = bytearray()
        self._remaining = 0

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes | bytearray) -> int:
        """Follow `data`; the count of its bytes that belong to the body (all of them
        until the body ends)."""
        index = 0
        end = len(data)
        while index < end and self._state != _DONE:
            state = self._state
            if state == _DATA:
                taken = min(self._remaining, end - index)
                index += taken
                self._remaining -= taken
                if self._remaining == 0:
                    self._state = _DATA_END
            elif state == _DATA_END:
                piece = data[index : index + 2 - len(self._line)]
                index += len(piece)
                self._line += piece
                if not b"\r\n".startswith(self._line):
                    raise FramingError("chunk data not followed by CRLF")
                if len(self._line) == 2:
                    self._line.clear()
                    self._state = _SIZE
            else:
                newline = data.find(b"\n", index)
                stop = end if newline < 0 else newline + 1
                self._line += data[index:stop]
                index = stop
                if len(self._line) > _MAX_LINE_BYTES:
                    raise FramingError(f"chunk line over {_MAX_LINE_BYTES} bytes")
                if newline >= 0:
                    self._end_line()
        return index

    def _end_line(self) -> None:
        line = bytes(self._line)
        self._line.clear()
        if not line.endswith(b"\r\n") or b"\r" in line[:-2] or b"\x00" in line:
            raise FramingError("a chunk line must end with CRLF and hold no CR or NUL")
        line = line[:-2]
        if self._state == _TRAILER:
            if not line:
                self._state = _DONE
            elif line[:1] in (b" ", b"\t"):
                raise FramingError("obsolete line folding in the chunked trailer")
            return
        match = _CHUNK_LINE.fullmatch(line)
        if match is None:
            raise FramingError(f"bad chunk size line {line[:64]!r}")
        size = int(match.group(1), 16)
        if size == 0:
            self._state = _TRAILER
        elif size > self._limit:
            raise BodyTooLarge(f"request body exceeds {self._limit} bytes")
        else:
            self._remaining = size
            self._state = _DATA

"""The upstream edge's hand-written parser before llhttp took its place, kept only as the
baseline `python -m bench --stages` measures the new path against (as h11 is kept for the
client edge). Not used by the router: a status line and header lines by regex, and a
chunked body decoded by a state machine over the received bytes.
"""

from __future__ import annotations

import re

__all__ = ["HandWrittenChunked", "parse_head_by_hand"]

_REASON = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([\t\x20-\x7e\x80-\xff]*?)[ \t]*")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_SIZE_LINE, _DATA, _DATA_END, _TRAILER, _ENDED = range(5)


def parse_head_by_hand(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], bool]:
    """The status, the headers (names lower-case) and keep-alive; `head` without its CRLF CRLF."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    version = status_line[:9]
    if version == b"HTTP/1.1 ":
        keep_alive = True
    elif version == b"HTTP/1.0 ":
        keep_alive = False
    else:
        raise ValueError("no HTTP/1.1 status line")
    code = status_line[9:12]
    if (
        not code.isdigit()
        or not b"100" <= code <= b"599"
        or (len(status_line) > 12 and status_line[12] != 32)
        or _REASON.fullmatch(status_line, 13) is None
    ):
        raise ValueError("malformed status line")
    headers = []
    for line in lines[1:]:
        match = _HEADER_LINE.fullmatch(line)
        if match is None:
            raise ValueError("malformed header line")
        headers.append((match[1].lower(), match[2]))
    return int(code), headers, keep_alive


class HandWrittenChunked:
    """The chunked decoder as the connection ran it: each read appended to what was left,
    then decoded as far as it goes."""

    __slots__ = ("_buffer", "_left", "_position", "_state")

    def __init__(self) -> None:
        self._buffer = b""
        self._position = 0
        self._left = 0
        self._state = _SIZE_LINE

    @property
    def ended(self) -> bool:
        return self._state == _ENDED

    def take(self, data: bytes) -> bytes:
        """The data bytes decoded once `data` (one read) has arrived."""
        if self._position < len(self._buffer):
            self._buffer = self._buffer[self._position :] + data
        else:
            self._buffer = data
        self._position = 0
        return self._take_chunked()

    def _take_chunked(self) -> bytes:
        buffer = self._buffer
        position = self._position
        size = len(buffer)
        state = self._state
        pieces: list[bytes] = []
        while position < size and state != _ENDED:
            if state == _DATA:
                end = min(size, position + self._left)
                pieces.append(buffer[position:end])
                self._left -= end - position
                position = end
                if not self._left:
                    state = _DATA_END
            elif state == _DATA_END:
                if size - position < 2:
                    if buffer[position] != 13:
                        raise ValueError("chunk data not followed by CRLF")
                    break
                if buffer[position : position + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                position += 2
                state = _SIZE_LINE
            else:
                end = buffer.find(b"\r\n", position)
                if end < 0:
                    if size - position > 4096:
                        raise ValueError("chunk line too long")
                    break
                line = buffer[position:end]
                position = end + 2
                if state == _TRAILER:
                    if not line:
                        state = _ENDED
                    elif _HEADER_LINE.fullmatch(line) is None:
                        raise ValueError("malformed trailer")
                    continue
                digits = line.partition(b";")[0].rstrip(b" \t")
                if _CHUNK_SIZE.fullmatch(digits) is None:
                    raise ValueError("malformed chunk size line")
                self._left = int(digits, 16)
                state = _DATA if self._left else _TRAILER
        self._position = position
        self._state = state
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

"""Where a relayed SSE stream may be cut: after a complete event, or past a size bound.

An SSE event ends at a blank line, and a line may end with LF, CRLF or CR (the
WHATWG event-stream grammar). So an event ends wherever two line ends meet: the byte
pairs LF LF, LF CR and CR CR cover every combination (CRLF CRLF holds LF CR, CR CRLF
holds CR CR, CRLF LF holds LF LF). The relay sends everything up to the last such end
at once and holds the rest, so that a worker breaking mid-event leaves the client whole
events followed by the router's error event.

Held bytes are bounded: past `max_pending` they go out even without an end (an event
that large is rare, and holding it unbounded is worse). Each received chunk is searched
once, with two bytes of the held tail for an end that straddles chunks, and held chunks
are joined once, when they go out: no byte is copied per chunk received.
"""

from __future__ import annotations

__all__ = ["MAX_PENDING_BYTES", "EventCutter"]

MAX_PENDING_BYTES = 64 * 1024
_ENDS = (b"\n\n", b"\n\r", b"\r\r")


def _last_event_end(data: bytes) -> int:
    """The index just past the last blank line in `data`, or 0 when there is none."""
    end = max(data.rfind(pair) for pair in _ENDS)
    if end < 0:
        return 0
    end += 2
    # A blank line ended by CRLF: keep its LF with it rather than start the next event.
    if data[end - 1] == 13 and data[end : end + 1] == b"\n":
        end += 1
    return end


class EventCutter:
    """Splits a byte stream into what may go to the client now and what must wait."""

    __slots__ = ("_held", "_held_size", "_max_pending", "_tail", "mid_event")

    def __init__(self, max_pending: int = MAX_PENDING_BYTES) -> None:
        self._max_pending = max_pending
        self._held: list[bytes] = []
        self._held_size = 0
        # The last two held bytes, for an event end that straddles two chunks.
        self._tail = b""
        self.mid_event = False
        """True when the bytes sent so far stop inside an event (a forced flush)."""

    @property
    def held(self) -> int:
        return self._held_size

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of `chunk` (with any held before it) that may be sent now; b"" if none."""
        if not chunk:
            return b""
        tail = self._tail
        if tail:
            end = _last_event_end(tail + chunk[:2])
            end = max(end - len(tail), _last_event_end(chunk)) if end else _last_event_end(chunk)
        else:
            end = _last_event_end(chunk)
        if end:
            out = self._take(chunk[:end] if end < len(chunk) else chunk)
            rest = chunk[end:]
            if rest:
                self._hold(rest)
            self.mid_event = False
            return out
        self._hold(chunk)
        if self._held_size > self._max_pending:
            self.mid_event = True
            return self._take(b"")
        return b""

    def flush(self) -> bytes:
        """Everything held (the stream ended cleanly: whatever it ends with is the worker's)."""
        return self._take(b"")

    def _hold(self, data: bytes) -> None:
        self._held.append(data)
        self._held_size += len(data)
        self._tail = (self._tail + data)[-2:] if len(data) < 2 else data[-2:]

    def _take(self, last: bytes) -> bytes:
        held = self._held
        if not held:
            return last
        if last:
            held.append(last)
        out = held[0] if len(held) == 1 else b"".join(held)
        self._held = []
        self._held_size = 0
        self._tail = b""
        return out

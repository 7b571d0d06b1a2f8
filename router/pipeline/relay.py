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

from typing import Final

__all__ = ["MAX_PENDING_BYTES", "EventCutter"]

MAX_PENDING_BYTES: Final = 64 * 1024


def _last_event_end(data: bytes) -> int:
    """The index just past the last blank line in `data`, or 0 when there is none."""
    end = data.rfind(b"\n\n")
    # Most workers end lines with LF alone: one search suffices. (`find`, not `in`: on
    # bytes, `in` makes and drops a TypeError first; docs/performance.md, "fifth round".)
    if data.find(b"\r") >= 0:
        end = max(end, data.rfind(b"\n\r"), data.rfind(b"\r\r"))
    if end < 0:
        return 0
    end += 2
    # A blank line ended by CRLF: keep its LF with it rather than start the next event.
    if data[end - 1] == 13 and data[end : end + 1] == b"\n":
        end += 1
    return end


class EventCutter:
    """Splits a byte stream into what may go to the client now and what must wait."""

    __slots__ = ("_held", "_held_size", "_max_pending", "mid_event")

    def __init__(self, max_pending: int = MAX_PENDING_BYTES) -> None:
        self._max_pending = max_pending
        self._held: list[bytes] = []
        self._held_size = 0
        self.mid_event = False
        """True when the bytes sent so far stop inside an event (a forced flush)."""

    @property
    def held(self) -> int:
        return self._held_size

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of `chunk` (with any held before it) that may be sent now; b"" if none."""
        if not chunk:
            return b""
        held = self._held
        if chunk.endswith(b"\n\n"):
            # The common case, a read that ends with an event: no search.
            end = len(chunk)
        elif held:
            # An end may straddle the join: search from the last two held bytes on.
            tail = held[-1][-2:]
            end = _last_event_end(tail + chunk) - len(tail)
        else:
            end = _last_event_end(chunk)
        if end > 0:
            self.mid_event = False
            if end == len(chunk):
                rest = b""
            else:
                chunk, rest = chunk[:end], chunk[end:]
            if held:
                held.append(chunk)
                chunk = b"".join(held)
                held.clear()
                self._held_size = 0
            if rest:
                held.append(rest)
                self._held_size = len(rest)
            return chunk
        held.append(chunk)
        self._held_size += len(chunk)
        if self._held_size > self._max_pending:
            self.mid_event = True
            return self.flush()
        return b""

    def flush(self) -> bytes:
        """Everything held (the stream ended cleanly: whatever it ends with is the worker's)."""
        held = self._held
        if not held:
            return b""
        out = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        self._held_size = 0
        return out

"""EventCutter: whole events go out as soon as they are complete, whatever their line ends."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.pipeline.relay import EventCutter

LINE_ENDS = [b"\n", b"\r\n", b"\r"]


def at_boundary(prefix: bytes) -> bool:
    """Whether `prefix` ends with two line ends in a row (CRLF counting as one)."""
    if prefix[-2:] in (b"\n\n", b"\r\r", b"\n\r"):
        return True
    return prefix[-2:] == b"\r\n" and prefix[-3:-2] in (b"\r", b"\n")


def test_each_line_end_style_ends_an_event_at_once() -> None:
    for end in LINE_ENDS:
        cutter = EventCutter()
        event = b"data: {}" + end + end
        assert cutter.feed(event + b"data: {") == event
        assert cutter.held == len(b"data: {")


def test_an_event_end_split_across_chunks_is_found() -> None:
    cutter = EventCutter()
    assert cutter.feed(b"data: 1\r\n\r") == b"data: 1\r\n\r"  # CR alone ends the blank line
    assert cutter.feed(b"\ndata: 2\r") == b""
    assert cutter.feed(b"\n") == b""
    assert cutter.feed(b"\r\n") == b"\ndata: 2\r\n\r\n"


def test_held_bytes_go_out_past_the_bound_and_the_cutter_says_so() -> None:
    cutter = EventCutter(max_pending=10)
    assert cutter.feed(b"data: 12345") == b"data: 12345"
    assert cutter.mid_event
    assert cutter.feed(b"6\n\n") == b"6\n\n"
    assert not cutter.mid_event and cutter.held == 0


def test_flush_gives_the_rest() -> None:
    cutter = EventCutter()
    assert cutter.feed(b"data: [DONE]") == b""
    assert cutter.flush() == b"data: [DONE]"
    assert cutter.flush() == b""


events = st.lists(
    st.tuples(
        st.binary(max_size=30).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
        st.sampled_from(LINE_ENDS),
    ),
    min_size=1,
    max_size=8,
)


@given(events=events, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_every_complete_event_goes_out_and_nothing_else(
    events: list[tuple[bytes, bytes]], cuts: list[int]
) -> None:
    stream = b"".join(b"data: " + payload + end + end for payload, end in events)
    cutter = EventCutter()
    sent = b""
    received = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        if cut <= received or cut > len(stream):
            continue
        sent += cutter.feed(stream[received:cut])
        received = cut
        # What went out is a prefix ending at an event boundary (or nothing) ...
        assert stream.startswith(sent)
        assert sent == b"" or at_boundary(sent)
        # ... and what is held has no complete event in it (an LF that completes the
        # CRLF of a blank line already sent excepted).
        for size in range(1, received - len(sent) + 1):
            if size == 1 and sent.endswith(b"\r") and stream[len(sent)] == 10:
                continue
            assert not at_boundary(stream[: len(sent) + size])
    assert sent + cutter.flush() == stream

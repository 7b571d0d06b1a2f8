"""The strict chunked-body check, fed whole and byte by byte."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http.server.chunked_framing import ChunkedFraming
from router.http.server.exceptions import BodyTooLarge
from router.http.server.request_framing import FramingError

LIMIT = 1000


def _feed(data: bytes, pieces: list[int] | None = None) -> ChunkedFraming:
    framing = ChunkedFraming(LIMIT)
    cuts = sorted(pieces or [])
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        framing.feed(data[start:end])
    return framing


VALID = [
    b"3\r\nabc\r\n0\r\n\r\n",
    b"3;name\r\nabc\r\n0\r\n\r\n",
    b"3;name=value;flag\r\nabc\r\n0\r\n\r\n",
    b'3 ; name = "quoted \\" value"\r\nabc\r\n0\r\n\r\n',
    b"A\r\n0123456789\r\n0\r\nx-trailer: 1\r\n\r\n",
    b"0000000000000003\r\nabc\r\n0\r\n\r\n",
    b"0\r\n\r\n",
]
BAD = {
    "size not hex": b"zz\r\nabc\r\n0\r\n\r\n",
    "size negative": b"-3\r\nabc\r\n0\r\n\r\n",
    "size of 17 digits": b"00000000000000003\r\nabc\r\n0\r\n\r\n",
    "nul in extension": b"3;a\x00\r\nabc\r\n0\r\n\r\n",
    "bare cr in extension": b"3;a\rb\r\nabc\r\n0\r\n\r\n",
    "bare lf line end": b"3\nabc\r\n0\r\n\r\n",
    "extension not a token": b"3;a b\r\nabc\r\n0\r\n\r\n",
    "empty extension": b"3;\r\nabc\r\n0\r\n\r\n",
    "data longer than size": b"2\r\nabc\r\n0\r\n\r\n",
    "folded trailer": b"0\r\nx: 1\r\n folded\r\n\r\n",
    "line too long": b"3;a=" + b"b" * 5000 + b"\r\n",
}


@pytest.mark.parametrize("data", VALID)
def test_valid_bodies_end_and_leave_what_follows_alone(data: bytes) -> None:
    framing = _feed(data + b"GET / HTTP/1.1\r\n\x00 anything")
    assert framing.done


@pytest.mark.parametrize("data", list(BAD.values()), ids=list(BAD))
def test_bad_framing_is_refused(data: bytes) -> None:
    with pytest.raises(FramingError):
        _feed(data)


def test_a_chunk_over_the_body_limit_is_413_at_its_size_line() -> None:
    with pytest.raises(BodyTooLarge):
        _feed(b"%x\r\n" % (LIMIT + 1))


def test_an_incomplete_body_is_not_done() -> None:
    assert not _feed(b"3\r\nab").done
    assert not _feed(b"3\r\nabc\r\n0\r\n").done


@settings(max_examples=200, deadline=None)
@given(
    data=st.sampled_from(VALID + list(BAD.values())),
    pieces=st.lists(st.integers(0, 64), max_size=6),
)
def test_the_verdict_does_not_depend_on_how_the_bytes_are_split(
    data: bytes, pieces: list[int]
) -> None:
    def verdict(cuts: list[int]) -> str:
        try:
            return "done" if _feed(data, cuts).done else "open"
        except (FramingError, BodyTooLarge) as exc:
            return type(exc).__name__

    assert verdict([min(cut, len(data)) for cut in pieces]) == verdict([])

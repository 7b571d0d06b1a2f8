"""The head checks made on our side (request smuggling), on heads h11 (as a reference
parser, in tests only) accepted."""

from __future__ import annotations

import h11
import pytest

from router.http.server.request_framing import FramingError, check_framing


def _check(raw: bytes) -> tuple[int, bool]:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    event = conn.next_event()
    assert type(event) is h11.Request
    return check_framing(list(event.headers), event.http_version, raw)


def test_a_plain_head_passes_with_its_length() -> None:
    raw = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
    assert _check(raw) == (len(raw) - 5, False)


def test_a_chunked_head_passes_and_says_so() -> None:
    raw = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert _check(raw) == (len(raw) - 5, True)


def test_a_space_after_a_newline_in_the_body_is_not_a_fold() -> None:
    raw = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n\n \n\t"
    assert _check(raw) == (len(raw) - 4, False)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            "both Content-Length and Transfer-Encoding",
        ),
        (
            b"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            "HTTP/1.0",
        ),
        (b"POST / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", "folding"),
        (b"POST / HTTP/1.1\r\nHost: a\r\nX: a\r\n\tb\r\n\r\n", "folding"),
        (b"POST / HTTP/1.1\nHost: a\nX: a\n b\n\n", "folding"),
    ],
)
def test_heads_another_parser_could_frame_differently_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(FramingError, match=why):
        _check(raw)


@pytest.mark.parametrize(
    "codings",
    [[b"gzip, chunked"], [b"chunked", b"chunked"], [b"identity"]],
    ids=["gzip-then-chunked", "two-fields", "identity"],
)
def test_a_transfer_encoding_other_than_one_lone_chunked_is_refused(
    codings: list[bytes],
) -> None:
    # llhttp takes `gzip, chunked` (h11 does not): the check does not count on the parser.
    headers = [(b"host", b"a"), *((b"transfer-encoding", coding) for coding in codings)]
    raw = b"POST / HTTP/1.1\r\n\r\n"
    with pytest.raises(FramingError, match="lone chunked"):
        check_framing(headers, b"1.1", raw)

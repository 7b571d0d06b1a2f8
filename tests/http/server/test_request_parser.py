"""The request parser (llhttp, framed by us): one request at a time, however the bytes
arrive, and what llhttp lets through refused all the same."""

from __future__ import annotations

import pytest

from router.http.server.exceptions import BodyTooLarge
from router.http.server.request_framing import FramingError
from router.http.server.request_parser import (
    CLOSED,
    END,
    NEED_DATA,
    ParseError,
    RequestHead,
    RequestParser,
)

POST = b"POST /v1/x?a=1 HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\nX-Pad: v \r\n\r\nhello"
CHUNKED = b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2;e=1\r\nlo\r\n0\r\n\r\n"
GET = b"GET /next HTTP/1.1\r\nHost: r\r\n\r\n"


def _events(parser: RequestParser) -> list[object]:
    events: list[object] = []
    while True:
        event = parser.next_event()
        if event is NEED_DATA:
            return events
        events.append(event)
        if event is END or event is CLOSED:
            return events


def _whole(data: bytes, step: int) -> tuple[RequestHead, bytes, bytes]:
    """Feeds `data` `step` bytes at a time; the head, the body and the bytes left over."""
    parser = RequestParser(65536, 1 << 20)
    seen: list[object] = []
    for index in range(0, len(data), step):
        parser.receive_data(data[index : index + step])
        seen += _events(parser)
        if seen and seen[-1] is END:
            break
    assert seen[-1] is END
    head = seen[0]
    assert isinstance(head, RequestHead)
    body = b"".join(event for event in seen[1:-1] if isinstance(event, bytes))
    return head, body, parser.trailing_data[0]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("request_bytes", [POST, CHUNKED], ids=["length", "chunked"])
def test_a_request_is_parsed_alike_however_its_bytes_arrive(
    request_bytes: bytes, step: int
) -> None:
    head, body, rest = _whole(request_bytes + GET, step)
    assert body == b"hello"
    assert head.method == b"POST" and head.http_version == b"1.1"
    assert rest == (request_bytes + GET)[len(request_bytes) :][: len(rest)]
    assert GET.startswith(rest)


def test_head_names_are_lower_case_and_values_trimmed() -> None:
    head, _, rest = _whole(POST + GET, 1000)
    assert head.target == b"/v1/x?a=1"
    assert head.headers == [(b"host", b"r"), (b"content-length", b"5"), (b"x-pad", b"v")]
    assert head.content_length == 5 and not head.chunked
    assert rest == GET


def test_a_pipelined_request_is_left_whole_for_the_next_parser() -> None:
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(GET + GET + b"GET /thi")
    assert isinstance(parser.next_event(), RequestHead)
    assert parser.next_event() is END
    assert parser.trailing_data == (GET + b"GET /thi", False)


def test_an_upgrade_request_is_a_plain_request_with_its_body() -> None:
    upgrade = (
        b"POST / HTTP/1.1\r\nHost: r\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )
    _, body, rest = _whole(upgrade + GET, 1000)
    assert body == b"hello"
    assert rest == GET


def test_end_of_stream_before_a_request_is_closed_and_within_one_an_error() -> None:
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(b"")
    assert parser.next_event() is CLOSED
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(POST[:-2])
    parser.receive_data(b"")
    assert isinstance(parser.next_event(), RequestHead)
    assert parser.next_event() == b"hel"
    with pytest.raises(ParseError):
        parser.next_event()


def test_a_head_over_the_limit_is_431_even_unfinished() -> None:
    parser = RequestParser(100, 1 << 20)
    parser.receive_data(b"GET / HTTP/1.1\r\nX: " + b"a" * 200)
    with pytest.raises(ParseError) as caught:
        parser.next_event()
    assert caught.value.status_hint == 431


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /\r\n\r\n",  # llhttp: HTTP/0.9
        b"GET / HTTP/2.0\r\nHost: r\r\n\r\n",  # llhttp takes it
        b"GET / HTTP/1.1\r\n\r\n",  # llhttp takes it: no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",  # llhttp takes it
        b"GET / HTTP/1.1\nHost: r\n\n",
        b"BREW / HTTP/1.1\r\nHost: r\r\n\r\n",
    ],
)
def test_requests_llhttp_lets_through_or_refuses_are_refused(request_bytes: bytes) -> None:
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(request_bytes)
    with pytest.raises(ParseError):
        _events(parser)


def test_gzip_then_chunked_which_llhttp_takes_is_a_framing_error() -> None:
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(
        b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    )
    with pytest.raises(FramingError):
        parser.next_event()


def test_a_chunk_past_the_body_limit_is_413_at_its_size_line() -> None:
    parser = RequestParser(65536, 10)
    parser.receive_data(b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\nff\r\n")
    assert isinstance(parser.next_event(), RequestHead)
    with pytest.raises(BodyTooLarge):
        parser.next_event()


def test_the_method_is_known_once_the_request_line_is_in() -> None:
    parser = RequestParser(65536, 1 << 20)
    assert parser.method is None
    parser.receive_data(
        b"HEAD / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    with pytest.raises(ParseError):
        parser.next_event()
    assert parser.method == b"HEAD"


def test_an_upgrade_request_with_a_chunked_body_is_refused() -> None:
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(
        b"POST / HTTP/1.1\r\nHost: r\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    with pytest.raises(FramingError):
        parser.next_event()


def test_a_bare_lf_head_is_refused_before_it_ends() -> None:
    # No CRLF CRLF will ever come: waiting for it would hold the connection to the timeout.
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(b"GET / HTTP/1.1\nHost: r\n")
    with pytest.raises(ParseError, match="bare LF"):
        parser.next_event()

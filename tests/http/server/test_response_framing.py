"""The server writes answers itself: each head, framing and keep-alive verdict equals h11's
for the same exchange (h11, the reference, runs in the tests only)."""

from __future__ import annotations

import itertools

import h11
import pytest

from router.http.server import response_framing
from router.http.server.messages import Headers
from router.http.server.response_framing import (
    CHUNKED,
    LENGTH,
    UNTIL_CLOSE,
    ResponseError,
    encode_head,
    request_keeps_alive,
)

REQUESTS = {
    "get-1.1": (b"GET", b"1.1", []),
    "head-1.1": (b"HEAD", b"1.1", []),
    "post-1.1-close": (b"POST", b"1.1", [(b"connection", b"close")]),
    "get-1.0": (b"GET", b"1.0", []),
    "head-1.0": (b"HEAD", b"1.0", []),
    "connect-1.1": (b"CONNECT", b"1.1", []),
    "get-1.1-keep-alive-close": (b"GET", b"1.1", [(b"Connection", b"Keep-Alive, Close")]),
}
HEADS: dict[str, Headers] = {
    "plain": [(b"content-type", b"text/plain"), (b"X-Worker", b"w 1")],
    "length": [(b"Content-Length", b"5")],
    "length-repeated": [(b"content-length", b"5 ,5"), (b"content-length", b"5")],
    "chunked": [(b"Transfer-Encoding", b"Chunked")],
    "both": [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")],
    "close": [(b"content-length", b"5"), (b"connection", b"close")],
    "upgrade": [(b"Connection", b"upgrade, keep-alive")],
    "host-last": [(b"x-a", b"1"), (b"host", b"h")],
    "text": [("content-type", "text/plain")],  # type: ignore[list-item]
}
STATUSES = [200, 204, 304, 404, 599, 999]


def _h11_exchange(
    method: bytes, version: bytes, request_headers: Headers, status: int, headers: Headers
) -> tuple[bytes, bool]:
    conn = h11.Connection(h11.SERVER)
    host = [] if version == b"1.0" else [(b"host", b"a")]
    conn.receive_data(
        b"%s / HTTP/%s\r\n%s\r\n"
        % (method, version, b"".join(b"%s: %s\r\n" % pair for pair in [*host, *request_headers]))
    )
    assert type(conn.next_event()) is h11.Request
    assert type(conn.next_event()) is h11.EndOfMessage
    head = conn.send(h11.Response(status_code=status, headers=list(headers), reason=b"R"))
    return head, conn.our_state is h11.SEND_BODY or conn.our_state is h11.DONE


@pytest.mark.parametrize(
    ("request_id", "head_id", "status"),
    list(itertools.product(REQUESTS, HEADS, STATUSES)),
)
def test_head_bytes_and_verdict_equal_h11s(request_id: str, head_id: str, status: int) -> None:
    method, version, request_headers = REQUESTS[request_id]
    headers = HEADS[head_id]
    expected, _ = _h11_exchange(method, version, request_headers, status, headers)
    head = encode_head(
        status,
        headers,
        b"R",
        method=method.decode(),
        http_version=version,
        # Header names reach the server lower-cased (as the request parser hands them).
        request_keep_alive=request_keeps_alive(
            version, [(name.lower(), value) for name, value in request_headers]
        ),
    )
    assert head.data == expected
    conn = h11.Connection(h11.SERVER)
    # h11's verdict after the whole exchange: reusable or must close.
    host = b"" if version == b"1.0" else b"host: a\r\n"
    conn.receive_data(
        b"%s / HTTP/%s\r\n%s%s\r\n"
        % (method, version, host, b"".join(b"%s: %s\r\n" % pair for pair in request_headers))
    )
    conn.next_event()
    conn.next_event()
    conn.send(h11.Response(status_code=status, headers=list(headers), reason=b"R"))
    if head.framing == LENGTH and head.length:
        conn.send(h11.Data(data=b"x" * head.length))
    if head.framing in (CHUNKED, UNTIL_CLOSE):
        conn.send(h11.Data(data=b"x"))
    if conn.our_state is not h11.SWITCHED_PROTOCOL:
        conn.send(h11.EndOfMessage())
    assert head.keep_alive == (conn.our_state is h11.DONE)


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x", b"a\rb")],
        [(b"x", b"a\x00")],
        [(b"x", b"trailing ")],
        [(b"x y", b"1")],
        [(b"", b"1")],
        [(b"content-length", b"5"), (b"content-length", b"6")],
        [(b"content-length", b"5, 6")],
        [(b"content-length", b"-1")],
        [(b"content-length", b"1" * 21)],
        [(b"transfer-encoding", b"gzip")],
        [(b"transfer-encoding", b"chunked"), (b"transfer-encoding", b"chunked")],
        [("x", "caf\u00e9")],
        pytest.param([(b"x", 5)], marks=pytest.mark.pure_only),  # compiled: a TypeError
    ],
)
def test_heads_h11_refuses_are_refused(headers: Headers) -> None:
    # h11 refuses text that is not ASCII, and a value that is no text, with Python's errors.
    with pytest.raises((h11.LocalProtocolError, UnicodeEncodeError, TypeError)):
        _h11_exchange(b"GET", b"1.1", [], 200, headers)
    with pytest.raises(ResponseError):
        encode_head(200, headers, b"", method="GET", http_version=b"1.1", request_keep_alive=True)


@pytest.mark.parametrize("status", [100, 199, 1000])
def test_a_status_outside_final_responses_is_refused(status: int) -> None:
    with pytest.raises(ResponseError):
        encode_head(status, [], b"", method="GET", http_version=b"1.1", request_keep_alive=True)


def _head(headers: Headers) -> bytes:
    return encode_head(
        200, headers, b"OK", method="POST", http_version=b"1.1", request_keep_alive=True
    ).data


def test_lines_checked_before_are_written_alike_and_framing_is_read_every_time() -> None:
    first = [(b"content-type", b"application/json"), (b"content-length", b"5")]
    assert _head(first) == _head(first)  # the second from the remembered lines
    # A length seen before still conflicts with another one, and a connection token seen
    # before still ends the connection.
    with pytest.raises(ResponseError):
        _head([(b"content-length", b"5"), (b"content-length", b"6")])
    head = encode_head(
        200,
        [(b"connection", b"close"), (b"content-length", b"0")],
        b"OK",
        method="POST",
        http_version=b"1.1",
        request_keep_alive=True,
    )
    assert not head.keep_alive


def test_a_refused_line_is_refused_every_time_and_never_remembered() -> None:
    for _ in range(3):
        with pytest.raises(ResponseError):
            _head([(b"x-bad", b"a\r\nInjected: 1")])
    assert all(b"Injected" not in line for _, line in response_framing._known_lines.values())


def test_the_remembered_lines_stay_bounded_under_ever_new_values() -> None:
    for number in range(response_framing.KNOWN_LINES * 3):
        _head([(b"x-request-id", b"%032x" % number)])
        assert len(response_framing._known_lines) <= response_framing.KNOWN_LINES
    # A line over the size bound is checked and written, never kept.
    long_value = b"v" * response_framing.KNOWN_LINE_BYTES
    assert long_value in _head([(b"x-long", long_value)])
    assert (b"x-long", long_value) not in response_framing._known_lines

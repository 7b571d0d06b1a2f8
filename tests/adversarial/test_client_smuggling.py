"""Request smuggling at the client edge (RFC 9112 sections 6.1 and 6.3): every request
whose framing another parser could read differently is answered 400, the connection is
closed, and the valid request pipelined behind it is never served (0 dispatches)."""

from __future__ import annotations

import orjson
import pytest
import trio

from tests.adversarial.support import (
    CHAT_BODY,
    FOLLOW_UP,
    assert_still_serving,
    exchange,
    open_setup,
    statuses,
)

GUARD_S = 20.0
_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
_CHUNKED = b"Transfer-Encoding: chunked\r\n"
_CHUNKED_BODY = b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)


def _with_headers(*lines: bytes, body: bytes = b"") -> bytes:
    return _HEAD + b"".join(lines) + b"\r\n" + body


def _chunked(body: bytes) -> bytes:
    return _with_headers(_CHUNKED, body=body)


CASES = {
    "content_length_and_transfer_encoding": _with_headers(
        b"Content-Length: 5\r\n", _CHUNKED, body=b"0\r\n\r\n"
    ),
    "transfer_encoding_and_content_length": _with_headers(
        _CHUNKED, b"Content-Length: 5\r\n", body=b"0\r\n\r\n"
    ),
    "two_different_content_lengths": _with_headers(
        b"Content-Length: 5\r\n", b"Content-Length: 6\r\n", body=b"{}   "
    ),
    "content_length_list_of_two": _with_headers(b"Content-Length: 5, 6\r\n", body=b"{}   "),
    "transfer_encoding_gzip_then_chunked": _with_headers(
        b"Transfer-Encoding: gzip, chunked\r\n", body=b"0\r\n\r\n"
    ),
    "transfer_encoding_chunked_then_gzip": _with_headers(
        b"Transfer-Encoding: chunked, gzip\r\n", body=b"0\r\n\r\n"
    ),
    "transfer_encoding_identity": _with_headers(b"Transfer-Encoding: identity\r\n"),
    "transfer_encoding_chunked_twice_in_one_field": _with_headers(
        b"Transfer-Encoding: chunked, chunked\r\n", body=b"0\r\n\r\n"
    ),
    "transfer_encoding_two_fields": _with_headers(_CHUNKED, _CHUNKED, body=b"0\r\n\r\n"),
    "transfer_encoding_in_http_1_0": _HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")
    + _CHUNKED
    + b"\r\n"
    + _CHUNKED_BODY,
    "chunk_size_not_hex": _chunked(b"zz\r\n" + CHAT_BODY + b"\r\n0\r\n\r\n"),
    "chunk_size_negative": _chunked(b"-%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)),
    "chunk_size_hex_prefix": _chunked(b"0x%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)),
    "chunk_size_overflow": _chunked(b"1" + b"0" * 20 + b"\r\n" + CHAT_BODY + b"\r\n0\r\n\r\n"),
    "chunk_size_past_64_bits": _chunked(b"1" + b"0" * 16 + b"\r\n" + CHAT_BODY + b"\r\n0\r\n\r\n"),
    "chunk_extension_with_nul": _chunked(
        b"%x;a=b\x00c\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)
    ),
    "chunk_extension_with_bare_cr": _chunked(
        b"%x;a\rb\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)
    ),
    "chunk_extension_with_bare_lf": _chunked(
        b"%x;a\nb\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)
    ),
    "chunk_extension_not_a_token": _chunked(
        b"%x;a b c\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)
    ),
    "chunk_data_longer_than_its_size": _chunked(b"2\r\n%s\r\n0\r\n\r\n" % CHAT_BODY),
    "obs_fold_space": _with_headers(
        b"X-Note: a\r\n", b" folded\r\n", b"Content-Length: %d\r\n" % len(CHAT_BODY), body=CHAT_BODY
    ),
    "obs_fold_tab": _with_headers(
        b"X-Note: a\r\n",
        b"\tfolded\r\n",
        b"Content-Length: %d\r\n" % len(CHAT_BODY),
        body=CHAT_BODY,
    ),
    "obs_fold_of_content_length": _with_headers(
        b"Content-Length:\r\n", b" %d\r\n" % len(CHAT_BODY), body=CHAT_BODY
    ),
    "nul_in_header_value": _with_headers(
        b"X-Note: a\x00b\r\n", b"Content-Length: %d\r\n" % len(CHAT_BODY), body=CHAT_BODY
    ),
    "nul_in_header_name": _with_headers(
        b"X-No\x00te: ab\r\n", b"Content-Length: %d\r\n" % len(CHAT_BODY), body=CHAT_BODY
    ),
    "bare_cr_in_header_value": _with_headers(
        b"X-Note: a\rb\r\n", b"Content-Length: %d\r\n" % len(CHAT_BODY), body=CHAT_BODY
    ),
    "bare_cr_in_header_name": _with_headers(
        b"X-No\rte: ab\r\n", b"Content-Length: %d\r\n" % len(CHAT_BODY), body=CHAT_BODY
    ),
}


@pytest.mark.parametrize("hostile", list(CASES.values()), ids=list(CASES))
async def test_unframeable_request_is_400_and_closes_before_the_pipelined_one(
    hostile: bytes,
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_setup() as setup:
            # `exchange` returns only once the router closed the connection.
            answer = await exchange(setup.port, hostile + FOLLOW_UP)
            assert statuses(answer) == [400], answer
            body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
            assert body["error"]["code"] == "invalid_request"
            assert b"connection: close" in answer.lower()
            assert setup.dispatches == 0
            await assert_still_serving(setup)


async def test_a_valid_chunked_request_with_a_pipelined_one_serves_both() -> None:
    """The control: the same framing done right is served, twice, on one connection."""
    valid = _chunked(b"%x;name=value;flag\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY))
    closing = FOLLOW_UP.replace(b"Host: router\r\n", b"Host: router\r\nConnection: close\r\n")
    with trio.fail_after(GUARD_S):
        async with open_setup() as setup:
            answer = await exchange(setup.port, valid + closing)
            assert statuses(answer) == [200, 200], answer
            assert setup.dispatches == 2
            await assert_still_serving(setup)

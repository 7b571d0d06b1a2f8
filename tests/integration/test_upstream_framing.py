"""The upstream connection's HTTP/1.1 client (our framing, llhttp's parsing) over a real socket pair.

The worker side writes raw bytes in pieces chosen by the test, each piece only once the
client blocked on its read, so every piece is one read on the client: framing split at
any byte, heads that are not HTTP/1.1, bodies that end early.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http.upstream.connection import UpstreamConnection
from router.http.upstream.exceptions import UpstreamProtocolError
from router.http.upstream.request_encoding import encode_request

GUARD_S = 10
REQUEST = encode_request("POST", "/v1/x", b"worker:1", [(b"x-test", b"1")], b"{}")

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"7\r\ndata: 1\r\n"
    b"B;ext=1\r\ndata: two\n\n\r\n"
    b"1\r\n!\r\n"
    b"0\r\nx-trailer: t\r\n\r\n"
)
CHUNKED_BODY = b"data: 1data: two\n\n!"


async def run_exchange(
    pieces: list[bytes], *, eof: bool = False, take_whole: bool = False
) -> tuple[UpstreamConnection, int, list[tuple[bytes, bytes]], list[bytes], bytes]:
    """Sends `pieces` one read at a time as the worker, then EOF when `eof`; returns the
    connection, the head, the body chunks as received and what the worker was sent.

    With `take_whole`, the client first takes the body if it came whole with the head:
    that body is the first chunk, prefixed `WHOLE:`.
    Raises what the client raised.
    """
    client_sock, worker_sock = trio.socket.socketpair()
    connection = UpstreamConnection(trio.SocketStream(client_sock))
    worker = trio.SocketStream(worker_sock)
    chunks: list[bytes] = []
    head: list[object] = []

    async def client() -> None:
        status, headers = await connection.exchange(REQUEST)
        head.extend((status, headers))
        whole = connection.take_whole_body() if take_whole else None
        if whole is not None:
            chunks.append(b"WHOLE:" + whole)
        while chunk := await connection.receive_data():
            chunks.append(chunk)

    received = b""
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client)
                while len(received) < len(REQUEST):
                    received += await worker.receive_some(65536)
                for piece in pieces:
                    await trio.testing.wait_all_tasks_blocked()
                    await worker.send_all(piece)
                if eof:
                    await trio.testing.wait_all_tasks_blocked()
                    await worker.send_eof()
    except BaseExceptionGroup as group:
        # The client task's one failure, as the client raised it.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        await worker.aclose()
        connection.close()
    status, headers = head
    assert isinstance(status, int) and isinstance(headers, list)
    return connection, status, headers, chunks, received


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, *cuts, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def test_chunked_body_split_at_every_byte_boundary() -> None:
    for cut in range(1, len(CHUNKED)):
        connection, status, headers, chunks, sent = trio.run(run_exchange, split(CHUNKED, [cut]))
        assert (status, b"".join(chunks)) == (200, CHUNKED_BODY), cut
        assert (b"transfer-encoding", b"chunked") in headers
        assert connection.recycle() is True
        assert sent == REQUEST
        # Never more reads than pieces: data is handed out as soon as a read brings it.
        assert 1 <= len(chunks) <= 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(CHUNKED) - 1), max_size=12))
def test_chunked_body_split_anywhere(cuts: list[int]) -> None:
    pieces = split(CHUNKED, cuts)
    connection, status, _, chunks, _ = trio.run(run_exchange, pieces)
    assert (status, b"".join(chunks)) == (200, CHUNKED_BODY)
    assert connection.recycle() is True
    assert len(chunks) <= len(pieces)


def test_a_body_that_came_whole_with_its_head_is_taken_without_a_read() -> None:
    response = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    head_end = response.index(b"\r\n\r\n") + 4
    for cut in range(1, len(response)):
        run = functools.partial(run_exchange, split(response, [cut]), take_whole=True)
        connection, status, _, chunks, _ = trio.run(run)
        if cut < head_end:
            # The second piece completed the head and brought the whole body with it.
            assert chunks == [b"WHOLE:hello"], cut
        else:
            # Part of the body (or none) came with the head: nothing taken, all read later.
            assert b"".join(chunks) == b"hello" and not chunks[0].startswith(b"WHOLE:"), cut
        assert status == 200 and connection.recycle() is True


def test_request_bytes_are_one_head_and_the_body() -> None:
    assert REQUEST == (
        b"POST /v1/x HTTP/1.1\r\nhost: worker:1\r\ncontent-length: 2\r\nx-test: 1\r\n\r\n{}"
    )
    for name, value in [(b"bad name", b"1"), (b"x", b"a\r\nb"), (b"", b"1")]:
        with pytest.raises(ValueError, match="cannot send header"):
            encode_request("POST", "/", b"h", [(name, value)], b"")
    with pytest.raises(ValueError, match="cannot send request line"):
        encode_request("POST", "/a b", b"h", [], b"")


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 55\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n",
    ],
)
def test_malformed_head_is_refused_after_the_first_byte(head: bytes) -> None:
    with pytest.raises(UpstreamProtocolError) as caught:
        trio.run(run_exchange, [head])
    assert caught.value.response_started is True


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabXY",
        b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2;a="q\r\nab\r\n0\r\n\r\n',
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\t\r\n\r\n2\r\nab\r\n0\r\n\r\n",
    ],
)
def test_body_ending_early_or_malformed_raises_every_time(response: bytes) -> None:
    async def scenario() -> None:
        with pytest.raises(UpstreamProtocolError) as caught:
            await run_exchange([response], eof=True)
        assert caught.value.response_started is True

    trio.run(scenario)


def test_end_before_any_response_byte_is_not_started() -> None:
    with pytest.raises(UpstreamProtocolError) as caught:
        trio.run(lambda: run_exchange([], eof=True))
    assert caught.value.response_started is False


@pytest.mark.parametrize(
    ("response", "body", "reusable"),
    [
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            b"ok",
            True,
        ),
        (b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n", b"", True),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok", b"ok", True),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", b"", True),
        (
            b"HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 2\r\n\r\nok",
            b"ok",
            False,
        ),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", b"ok", False),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1", b"ok", False),
        # Repeated, one value: taken (llhttp alone would refuse it).
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nContent-Length: 2\r\n\r\nok", b"ok", True),
        # No body whatever the head says (llhttp alone would refuse the pair).
        (
            b"HTTP/1.1 204 No Content\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
            b"",
            True,
        ),
        (b"HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n", b"", True),
        (CHUNKED, CHUNKED_BODY, True),
        # Bytes after the last chunk, in the same read: the body is whole, the connection spent.
        (CHUNKED + b"\r\n", CHUNKED_BODY, False),
        (CHUNKED + b"\n", CHUNKED_BODY, False),
        (CHUNKED + b"X", CHUNKED_BODY, False),
        (CHUNKED + b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc", CHUNKED_BODY, False),
    ],
)
def test_framing_and_reuse(response: bytes, body: bytes, reusable: bool) -> None:
    connection, _, _, chunks, _ = trio.run(run_exchange, [response])
    assert b"".join(chunks) == body
    assert connection.recycle() is reusable


@pytest.mark.parametrize("extra", [b"\r\n", b"\n\n", b"HTTP/1.1 204 No Content\r\n\r\n"])
def test_bytes_after_the_last_chunk_spend_the_connection_however_the_reads_fall(
    extra: bytes,
) -> None:
    """The last chunk's end and the bytes past it split anywhere across reads that all
    arrive before the end is seen."""
    response = CHUNKED + extra
    end = len(CHUNKED)
    for cut in range(end - 6, len(response)):
        if cut == end:
            continue  # the extra bytes would come in a read after the end: never made
        connection, status, _, chunks, _ = trio.run(run_exchange, split(response, [40, cut]))
        assert (status, b"".join(chunks)) == (200, CHUNKED_BODY), cut
        assert connection.recycle() is False, cut


def test_a_head_request_answered_with_a_chunked_head_has_no_body() -> None:
    async def scenario() -> tuple[int, bytes, bool]:
        client_sock, worker_sock = trio.socket.socketpair()
        connection = UpstreamConnection(trio.SocketStream(client_sock))
        worker = trio.SocketStream(worker_sock)
        try:
            with trio.fail_after(GUARD_S):
                await worker.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                status, _ = await connection.exchange(REQUEST, bodyless=True)
                return status, await connection.receive_data(), connection.recycle()
        finally:
            await worker.aclose()
            connection.close()

    assert trio.run(scenario) == (200, b"", True)


def test_body_until_end_of_stream_is_complete_and_not_reusable() -> None:
    pieces = [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\none ", b"two"]
    connection, status, _, chunks, _ = trio.run(lambda: run_exchange(pieces, eof=True))
    assert (status, chunks) == (200, [b"one ", b"two"])
    assert connection.recycle() is False

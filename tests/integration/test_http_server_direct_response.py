"""The server's whole-response path: bytes and connection state as h11 would have them."""

from __future__ import annotations

import logging

import h11
import pytest
import trio

from router.http.server.loop import serve_http
from router.http.server.messages import Headers, Request, ResponseWriter
from router.http.server.response_framing import ResponseError
from router.http.server.settings import ServerSettings

GUARD_S = 5.0


class Answer:
    """Answers every request with `headers` and a fixed body; counts the requests."""

    def __init__(self, headers: Headers, status: int = 200) -> None:
        self.headers = headers
        self.status = status
        self.seen = 0

    async def __call__(self, request: Request, writer: ResponseWriter) -> None:
        self.seen += 1
        await writer.respond(self.status, self.headers, b"hello")


async def _exchange(handler: Answer, requests: bytes, answers: int) -> tuple[bytes, bool]:
    """Sends `requests` on one connection; the bytes the server sent until `answers`
    whole responses arrived or it closed first, and whether it closed first."""
    received = b""
    closed = False
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, handler)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(requests)
                while _whole_responses(received) < answers:
                    data = await stream.receive_some(65536)
                    if not data:
                        closed = True
                        break
                    received += data
            nursery.cancel_scope.cancel()
    return received, closed


def _whole_responses(raw: bytes) -> int:
    count = 0
    while b"\r\n\r\n" in raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lengths = [
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        size = lengths[0] if lengths else 0
        if len(rest) < size:
            break
        count += 1
        raw = rest[size:]
    return count


def _as_h11_writes(request: bytes, status: int, headers: Headers, date: bytes) -> bytes:
    """What h11 writes for the same exchange, given the `date` the server used."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    conn.next_event()
    conn.next_event()
    head = [*headers, (b"content-length", b"5"), (b"server", b"trio-router"), (b"date", date)]
    response = h11.Response(status_code=status, headers=head, reason=b"OK")
    return b"".join(
        (conn.send(response), conn.send(h11.Data(data=b"hello")), conn.send(h11.EndOfMessage()))
    )


def _date_of(raw: bytes) -> bytes:
    for line in raw.split(b"\r\n"):
        if line.startswith(b"date: "):
            return line[len(b"date: ") :]
    raise AssertionError(f"no date header in {raw!r}")


GET = b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n"


async def test_answer_bytes_equal_h11s_and_the_connection_is_reused() -> None:
    headers = [(b"content-type", b"application/json"), (b"X-Router-Worker", b"w 1")]
    handler = Answer(headers)
    received, _ = await _exchange(handler, GET * 3, 3)
    assert received.count(b"HTTP/1.1 200 OK") == 3
    assert received.startswith(_as_h11_writes(GET, 200, headers, _date_of(received)))
    assert handler.seen == 3


@pytest.mark.parametrize(
    ("request_bytes", "headers"),
    [
        (b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n", []),
        (b"GET /x HTTP/1.0\r\n\r\n", []),
        (GET, [(b"connection", b"close")]),
    ],
    ids=["client-says-close", "http-1.0", "handler-says-close"],
)
async def test_closing_exchanges_say_close_and_end_the_connection(
    request_bytes: bytes, headers: Headers
) -> None:
    handler = Answer(headers)
    received, closed = await _exchange(handler, request_bytes, 2)
    assert closed
    assert received.count(b"HTTP/1.1 200 OK") == 1
    assert b"\r\nconnection: close\r\n" in received.lower()
    assert handler.seen == 1


@pytest.mark.parametrize(
    "bad",
    [
        (b"x-bad", b"a\nb"),
        (b"x-bad", b" padded"),
        (b"bad name", b"seen-nowhere"),
        (b"x-bad", b"a\x00b"),
    ],
    ids=["newline", "leading-space", "space-in-name", "nul"],
)
async def test_header_http_refuses_becomes_a_500_and_the_connection_keeps_serving(
    caplog: pytest.LogCaptureFixture, bad: tuple[bytes, bytes]
) -> None:
    handler = Answer([bad])
    received, _ = await _exchange(handler, GET * 2, 2)
    assert received.count(b"HTTP/1.1 500 ") == 2
    assert bad[1] not in received
    assert handler.seen == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is ResponseError


async def test_head_request_keeps_length_without_body() -> None:
    handler = Answer([])
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, handler)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"HEAD /x HTTP/1.1\r\nhost: a\r\n\r\n" + GET)
                received = b""
                while b"hello" not in received:
                    data = await stream.receive_some(65536)
                    assert data
                    received += data
            nursery.cancel_scope.cancel()
    head, _, rest = received.partition(b"\r\n\r\n")
    assert b"content-length: 5" in head
    assert rest.startswith(b"HTTP/1.1 200 OK")
    assert handler.seen == 2


class Stream:
    """Streams `chunks` after a head with `headers` (chunked unless a length is given)."""

    def __init__(self, headers: Headers, chunks: list[bytes]) -> None:
        self.headers = headers
        self.chunks = chunks

    async def __call__(self, request: Request, writer: ResponseWriter) -> None:
        await writer.start(200, self.headers)
        for chunk in self.chunks:
            await writer.write(chunk)
        await writer.finish()


async def _read_stream(handler: Stream, end: bytes) -> bytes:
    """The bytes of one streamed answer to GET, up to and including `end`."""
    received = b""
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, handler)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(GET)
                while not received.endswith(end):
                    data = await stream.receive_some(65536)
                    assert data
                    received += data
            nursery.cancel_scope.cancel()
    return received


def _h11_stream(headers: Headers, chunks: list[bytes], date: bytes) -> bytes:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(GET)
    conn.next_event()
    conn.next_event()
    head = [*headers, (b"server", b"trio-router"), (b"date", date)]
    parts = [conn.send(h11.Response(status_code=200, headers=head, reason=b"OK"))]
    parts.extend(conn.send(h11.Data(data=chunk)) for chunk in chunks)
    parts.append(conn.send(h11.EndOfMessage()))
    return b"".join(parts)


async def test_streamed_chunks_are_framed_as_h11_frames_them() -> None:
    headers = [(b"content-type", b"text/event-stream")]
    chunks = [b"data: 1\n\n", b"", b"data: " + b"x" * 300 + b"\n\n"]
    received = await _read_stream(Stream(headers, chunks), b"0\r\n\r\n")
    assert received == _h11_stream(headers, chunks, _date_of(received))
    assert received.count(b"\r\n0\r\n\r\n") == 1


async def test_streamed_body_with_a_length_is_sent_unframed() -> None:
    headers = [(b"content-length", b"6")]
    chunks = [b"abc", b"def"]
    received = await _read_stream(Stream(headers, chunks), b"abcdef")
    assert received == _h11_stream(headers, chunks, _date_of(received))
    assert b"transfer-encoding" not in received.lower()


async def test_head_timeout_spans_only_head_waits_across_cycles() -> None:
    # The handler outlasts both timeouts on each of two requests on one connection; the
    # third head then stalls and is still cut off.
    handled: list[float] = []

    async def slow(request: Request, writer: ResponseWriter) -> None:
        start = trio.current_time()
        await trio.sleep(0.3)  # the handler's own work, outlasting both head timeouts
        handled.append(trio.current_time() - start)
        await writer.respond(200, [], b"hello")

    settings = ServerSettings(header_timeout_s=0.1, idle_timeout_s=0.1)
    received = b""
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, slow, settings)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(GET + GET)
                while _whole_responses(received) < 2:
                    received += await stream.receive_some(65536)
                await stream.send_all(b"GET / HTTP/1.1\r\n")
                while data := await stream.receive_some(65536):
                    received += data
            nursery.cancel_scope.cancel()
    assert received.count(b"HTTP/1.1 200 OK") == 2
    assert received.count(b"HTTP/1.1 408 ") == 1
    assert len(handled) == 2
    assert min(handled) >= 0.3

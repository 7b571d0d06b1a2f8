"""The response writer's body writes over a real socket pair: each framing as h11 reads
it, and a client that left or stopped reading ends the write with `ClientDisconnected`,
the request marked as the client's departure and the cause kept (the pipeline tells a
stalled client from a departed one by it)."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from router.http.direct_socket import DirectSocket, SendStalled
from router.http.server.messages import ClientDisconnected, Request
from router.http.server.response_writer import ResponseWriter
from tests.support.http_client import RawClient

WRITE_TIMEOUT_S = 5.0


def writer_pair(
    method: str = "GET",
) -> tuple[ResponseWriter, Request, DirectSocket, socket.socket]:
    """A writer on our end of a socket pair, its request, our end and the client's."""
    ours, client = socket.socketpair()
    request = Request(method, "/", [], b"")
    sock = DirectSocket(ours)
    writer = ResponseWriter(
        sock,
        request,
        http_version=b"1.1",
        date=lambda: b"Mon, 07 Dec 2026 00:00:00 GMT",
        closing=lambda: False,
        write_timeout_s=WRITE_TIMEOUT_S,
    )
    return writer, request, sock, client


async def read_answer(client: socket.socket, method: str) -> tuple[int, bytes]:
    """The status and the whole body, as an HTTP client reads what `client` received."""
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(client))
    with trio.fail_after(5):  # a body that never ends would hang the read
        response = await RawClient(stream).read_response(method)
    await stream.aclose()
    return response.status, response.body


@pytest.mark.parametrize(
    ("method", "headers", "body"),
    [
        ("GET", [], b"data: 1\n\ndata: 2\n\n"),
        ("GET", [(b"content-length", b"18")], b"data: 1\n\ndata: 2\n\n"),
        ("HEAD", [], b""),
    ],
    ids=["chunked", "length", "head-request"],
)
def test_body_writes_arrive_as_the_framing_says(
    method: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    async def main() -> None:
        writer, _, sock, client = writer_pair(method)
        await writer.start(200, headers)
        await writer.write(b"data: 1\n\n")
        await writer.write(b"")  # nothing to send: no empty chunk, which would end the body
        await writer.write(b"data: 2\n\n")
        await writer.finish()
        assert await read_answer(client, method) == (200, body)
        sock.close()

    trio.run(main)


def test_a_write_to_a_departed_client_raises_client_disconnected() -> None:
    async def main() -> None:
        writer, request, sock, client = writer_pair()
        await writer.start(200, [])
        client.close()
        with pytest.raises(ClientDisconnected) as raised:
            for _ in range(100):  # the first send after a close may still be taken
                await writer.write(b"data: x\n\n")
        assert request.client_gone is True
        assert isinstance(raised.value.__cause__, trio.BrokenResourceError)
        sock.close()

    trio.run(main)


def test_a_write_to_a_client_that_stopped_reading_ends_after_the_write_timeout() -> None:
    async def main() -> None:
        writer, request, sock, client = writer_pair()
        await writer.start(200, [])
        began = trio.current_time()
        event = b"data: " + b"x" * 65536 + b"\n\n"
        with pytest.raises(ClientDisconnected) as raised:
            while True:  # the socket buffers fill; then no byte is taken
                await writer.write(event)
        assert trio.current_time() - began >= WRITE_TIMEOUT_S
        assert request.client_gone is True
        assert isinstance(raised.value.__cause__, SendStalled)
        assert "stopped reading" in str(raised.value)
        client.close()
        sock.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

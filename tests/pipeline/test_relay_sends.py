"""The relay's sends to the client: the head leaves with the first events, the last events
with the answer's end. Counted at the client socket, over real loopback sockets, with the
router's own pool, relay and response writer."""

from __future__ import annotations

import socket

import h11
import pytest
import trio

from router.http.direct_socket import DirectSocket
from router.http.server.messages import Request
from router.http.server.response_writer import ResponseWriter
from router.http.upstream.pool import open_upstream_pool
from router.pipeline.dispatch import (
    Timeouts,
    first_stream_chunk,
    open_upstream_response,
    relay_stream,
)
from router.pipeline.stall_watch import StallWatch

EVENTS = [b'data: {"n": %d}\n\n' % n for n in range(5)] + [b"data: [DONE]\n\n"]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"
TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=5.0, stream_idle_s=5.0)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class CountingSocket(DirectSocket):
    """The client's socket in the router, counting its sends; `relayed` is set after each."""

    __slots__ = ("relayed", "sends")

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.sends = 0
        self.relayed = trio.Event()

    async def send_all(self, data: bytes, *, stall_timeout_s: float | None = None) -> None:
        await super().send_all(data, stall_timeout_s=stall_timeout_s)
        self.sends += 1
        self.relayed.set()
        self.relayed = trio.Event()


async def worker(
    listener: trio.SocketListener, pieces: list[bytes], client: CountingSocket | None
) -> None:
    """Answers one request with `pieces`, each its own send; with `client`, each after the
    previous one reached the client (so each arrives at the router on its own)."""
    async with listener, await listener.accept() as stream:
        received = b""
        while b"\r\n\r\n" not in received:
            received += await stream.receive_some(65536)
        for index, piece in enumerate(pieces):
            while client is not None and client.sends < index:
                await client.relayed.wait()
            await stream.send_all(piece)
        await trio.sleep_forever()


def client_events(data: bytes) -> tuple[int, bytes, bool]:
    """The status, the body and whether the body ended, as an HTTP client reads them."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
    connection.receive_data(data)
    status, body, ended = 0, b"", False
    while (event := connection.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            ended = True
    return status, body, ended


async def relay(pieces: list[bytes], paced: bool) -> tuple[int, bytes]:
    """Relays the worker's `pieces` to a client socket: the sends made, the client's bytes."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    client_side, router_side = socket.socketpair()
    counting = CountingSocket(router_side)
    request = Request("POST", "/v1/chat/completions", [], b"")
    writer = ResponseWriter(
        counting,
        request,
        http_version=b"1.1",
        date=lambda: b"Sat, 05 Dec 2026 00:00:00 GMT",
        closing=lambda: False,
        write_timeout_s=5.0,
    )
    async with open_upstream_pool() as pool, trio.open_nursery() as nursery:
        nursery.start_soon(worker, listener, pieces, counting if paced else None)
        url = f"http://127.0.0.1:{port}"
        async with open_upstream_response(
            pool, url, "/v1/chat/completions", [], b"{}", TIMEOUTS
        ) as response:
            first = await first_stream_chunk(response, url, TIMEOUTS.stream_idle_s)
            ended = await relay_stream(
                response,
                first,
                writer,
                url,
                StallWatch(TIMEOUTS.stream_idle_s),
                head=[(b"content-type", b"text/event-stream")],
            )
            assert ended is None
        nursery.cancel_scope.cancel()
    client_side.setblocking(False)
    data = b""
    while True:
        try:
            piece = client_side.recv(65536)
        except BlockingIOError:
            break
        if not piece:
            break
        data += piece
    client_side.close()
    counting.close()
    return counting.sends, data


@pytest.mark.pure_only  # counts sends by subclassing DirectSocket, which compiled is final
@pytest.mark.parametrize("paced", [False, True], ids=["at-once", "one-event-per-read"])
def test_the_head_goes_with_the_first_events_and_the_last_with_the_end(paced: bool) -> None:
    if paced:
        # Each event its own read; the last one arrives with the body's end.
        pieces = [HEAD + chunk(EVENTS[0])]
        pieces += [chunk(event) for event in EVENTS[1:-1]]
        pieces.append(chunk(EVENTS[-1]) + END)
    else:
        pieces = [HEAD + b"".join(chunk(event) for event in EVENTS) + END]
    sends, data = trio.run(relay, pieces, paced)
    status, body, ended = client_events(data)
    assert (status, body, ended) == (200, b"".join(EVENTS), True)
    # At once: the head with every event, then the end (was 3: head, events, end). One
    # event per read: the head with the first, one per event between, the last with the
    # end (was 2 more: the head and the end alone).
    assert sends == (2 if not paced else len(EVENTS))

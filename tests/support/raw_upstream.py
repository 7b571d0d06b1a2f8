"""A raw HTTP/1.1 server on trio + h11 whose every answer a test scripts.

The pool's integration tests need a worker that misbehaves on cue: reset after the
response head, hold a chunk until told, close a kept-alive connection without a word.
An off-the-shelf server does none of that, so each test passes a `respond` coroutine that
drives one `Exchange` by hand.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import h11
import trio


class Exchange:
    """One request received on a server connection, and the means to answer it."""

    def __init__(
        self,
        stream: trio.SocketStream,
        connection: h11.Connection,
        connection_id: int,
        index: int,
        request: h11.Request,
        body: bytes,
    ) -> None:
        self._stream = stream
        self._h11 = connection
        self.connection_id = connection_id
        """1 for the first connection the server accepted, 2 for the next, ..."""
        self.index = index
        """How many requests this connection carried before this one."""
        self.request = request
        self.body = body
        self.closed = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.request.headers:
            if key == name:
                return value
        return None

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        framing = [(b"content-length", b"%d" % len(body))]
        await self.start(status, framing + headers)
        if body:
            await self.send(body)
        await self.end()

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Sends the head; without a content-length h11 frames the body as chunked."""
        await self._send(h11.Response(status_code=status, headers=headers))

    async def send(self, data: bytes) -> None:
        await self._send(h11.Data(data=data))

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def send_raw(self, data: bytes) -> None:
        """Bytes on the wire, past h11: for heads that break off half-way."""
        await self._stream.send_all(data)

    async def hold_until_peer_closes(self) -> None:
        """Keeps the connection open, reading and dropping bytes, until the client closes
        it; then closes it here. For answers after which a client must not reuse it."""
        try:
            while await self._stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.close()

    def close(self) -> None:
        """A clean close (FIN); the connection serves nothing more."""
        self.closed = True
        self._stream.socket.close()

    def reset(self) -> None:
        """An abortive close: SO_LINGER 0 makes the kernel send RST instead of FIN."""
        self.closed = True
        sock = self._stream.socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    async def _send(self, event: h11.Event) -> None:
        data = self._h11.send(event)
        if data:
            await self._stream.send_all(data)


Respond = Callable[[Exchange], Awaitable[None]]


class RawUpstream:
    """What the server saw, for assertions about cost."""

    def __init__(self) -> None:
        self.port = 0
        self.accepted = 0
        self.ended = 0
        """Connections finished on the server side (peer closed, reset, or closed here)."""
        self.requests = 0
        self._changed = trio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_ended(self, count: int) -> None:
        """Waits until `count` connections have ended on the server side."""
        while self.ended < count:
            await self._changed.wait()

    def _note_end(self) -> None:
        self.ended += 1
        self._changed.set()
        self._changed = trio.Event()


async def _serve_connection(
    stream: trio.SocketStream, upstream: RawUpstream, respond: Respond
) -> None:
    upstream.accepted += 1
    connection_id = upstream.accepted
    connection = h11.Connection(h11.SERVER)
    index = 0
    try:
        while True:
            request: h11.Request | None = None
            chunks: list[bytes] = []
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            assert request is not None
            upstream.requests += 1
            exchange = Exchange(stream, connection, connection_id, index, request, b"".join(chunks))
            await respond(exchange)
            if exchange.closed or connection.our_state is not h11.DONE:
                return
            connection.start_next_cycle()
            index += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
        return
    finally:
        upstream._note_end()


async def serve_raw_upstream(
    respond: Respond, *, task_status: trio.TaskStatus[RawUpstream] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serves on 127.0.0.1, a free port, until cancelled; reports the `RawUpstream`."""
    upstream = RawUpstream()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(
                trio.serve_tcp,
                partial(_serve_connection, upstream=upstream, respond=respond),
                0,
                host="127.0.0.1",
            )
        )
        upstream.port = listeners[0].socket.getsockname()[1]
        task_status.started(upstream)


@asynccontextmanager
async def open_raw_upstream(respond: Respond) -> AsyncIterator[RawUpstream]:
    """A running raw server for the duration of the block."""
    async with trio.open_nursery() as nursery:
        upstream = await nursery.start(serve_raw_upstream, respond)
        yield upstream
        nursery.cancel_scope.cancel()

"""A one-connection HTTP/1.1 test client on a raw trio socket, parsed with h11.

No pool, so a test sees exactly which socket carries which request. Requests may go out
through h11 (`request`, `send_request`) or as raw bytes (`send_raw`); for the latter,
`read_head`/`read_response` tell h11 a request went out so it accepts the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import h11
import orjson
import trio

_RECEIVE_BYTES = 65536


@dataclass
class RawResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        return orjson.loads(self.body)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    """Every byte `stream` receives until the peer closes it (a reset counts)."""
    received = []
    while True:
        try:
            chunk = await stream.receive_some(_RECEIVE_BYTES)
        except trio.BrokenResourceError:
            break
        if not chunk:
            break
        received.append(chunk)
    return b"".join(received)


class RawClient:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> None:
        self._next_cycle()
        head = [("host", "test"), *(headers or [])]
        if body:
            head.append(("content-length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=target, headers=head))
        if body:
            data += self.h11.send(h11.Data(data=body))
        data += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> RawResponse:
        await self.send_request(method, target, headers, body)
        return await self.read_response(method)

    async def read_head(self, method: str = "GET") -> RawResponse:
        """The next final response's status and headers (1xx skipped)."""
        self._next_cycle()
        if self.h11.our_state is h11.IDLE:
            # The request went out raw: tell h11 so it accepts a response.
            self.h11.send(h11.Request(method=method, target="/", headers=[("host", "raw")]))
            self.h11.send(h11.EndOfMessage())
        while True:
            event = await self._next_event()
            if type(event) is h11.Response:
                return RawResponse(event.status_code, list(event.headers))

    async def read_chunk(self) -> bytes | None:
        """The next body piece as h11 delivered it, or None at the end of the body."""
        while True:
            event = await self._next_event()
            if type(event) is h11.Data:
                return bytes(event.data)
            if type(event) is h11.EndOfMessage:
                return None

    async def read_response(self, method: str = "GET") -> RawResponse:
        response = await self.read_head(method)
        while (chunk := await self.read_chunk()) is not None:
            response.chunks.append(chunk)
        return response

    async def read_until_eof(self) -> bytes:
        """Every byte left on the socket until the server closes it (a reset counts)."""
        return self.h11.trailing_data[0] + await read_until_closed(self.stream)

    def _next_cycle(self) -> None:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()

    async def _next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(_RECEIVE_BYTES))

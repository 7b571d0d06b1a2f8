"""The transport-agnostic request and response writer every handler speaks.

The native server (`router.http.server.loop`) and the ASGI adapter both build a `Request`
and hand the handler a `ResponseWriter`, so a handler never knows which front it runs on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Headers = Sequence[tuple[bytes, bytes]]


class ClientDisconnected(Exception):
    """The client went away: a send failed or the socket reached end-of-stream."""


@dataclass(slots=True, init=False)
class Request:
    """One inbound request, body fully read (bounded by the server's body limit).

    Header names are lower-case bytes.
    """

    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    client: tuple[str, int] | None = None
    client_gone: bool = False
    path: str = field(init=False)
    query: str = field(init=False)

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        client: tuple[str, int] | None = None,
        client_gone: bool = False,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.client = client
        self.client_gone = client_gone
        path, _, query = target.partition("?")
        self.path = path
        self.query = query

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class ResponseWriter(Protocol):
    """Where a handler writes its answer.

    Either `respond()` once, or `start()`, any number of `write()`, then `finish()`.
    `write()` raises `ClientDisconnected` when the client is gone. `start(..., first)` and
    `finish(last)` carry body bytes in the same send as the head or the end: bytes that
    are at hand then leave in one system call instead of two.
    """

    @property
    def started(self) -> bool:
        """True once the status line went out (or was committed to)."""
        ...

    async def respond(self, status: int, headers: Headers, body: bytes) -> None: ...

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def finish(self, last: bytes = b"") -> None: ...

    async def abort(self, *, reset: bool = False) -> None:
        """Drop the connection without finishing the answer (a TCP RST when `reset`)."""
        ...


Handler = Callable[[Request, ResponseWriter], Awaitable[None]]

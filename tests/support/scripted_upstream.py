"""A worker's response scripted in memory, for tests that stand in for the upstream pool."""

from __future__ import annotations

import math

import trio


class ScriptedResponse:
    """An `UpstreamResponse` stand-in: a JSON answer whose body is read with `receive_some`."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.headers = [(b"content-type", b"application/json")]
        self._body = body

    def abandon(self) -> None:
        """A relay gives the answer up: nothing more comes."""
        self._body = b""

    def take_whole_body(self) -> None:
        """The body never came with the head here: it is read with `receive_some`."""
        return None

    async def receive_some(self, deadline: float = math.inf) -> bytes:
        await trio.lowlevel.checkpoint()
        body, self._body = self._body, b""
        return body

"""A worker's response whose head has arrived, as the pool hands it to the caller."""

from __future__ import annotations

from router.http.upstream_connection import UpstreamConnection

__all__ = ["UpstreamResponse"]


class UpstreamResponse:
    """A response whose head has arrived; the body is read on demand."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(
        self, connection: UpstreamConnection, status: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._connection = connection
        self.status = status
        self.headers = headers

    async def receive_some(self) -> bytes:
        """The next body bytes as they arrive; b"" once the body has ended.

        Raises `UpstreamProtocolError` (response_started=True) when the body breaks off.
        Cancellation: the request's context manager closes the connection.
        """
        return await self._connection.receive_data()

    def take_whole_body(self) -> bytes | None:
        """The whole body when it has already arrived (no wait, so no timeout to set);
        None when it has not, with nothing taken."""
        return self._connection.take_whole_body()

    async def read(self) -> bytes:
        """The whole remaining body. Errors and cancellation as `receive_some`."""
        chunks = []
        while chunk := await self._connection.receive_data():
            chunks.append(chunk)
        return b"".join(chunks)

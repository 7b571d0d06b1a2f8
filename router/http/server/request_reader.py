"""Reading one request from a client connection: its head within the header timeout, then
its whole body within the body timeout, checked and bounded on the way.

Every refusal is raised as a `Refusal` (400 framing, 408 timeout, 413 body, 431 head,
503 body budget); the connection answers it and closes. Nothing here answers or closes.
"""

from __future__ import annotations

from typing import Final

import trio

from router.http import clock
from router.http.direct_socket import DirectSocket
from router.http.server.connection_reader import ConnectionReader
from router.http.server.exceptions import BodyTooLarge, ClientTooSlow, HeadTooLarge, Refusal
from router.http.server.load import BodyReservation
from router.http.server.messages import Request
from router.http.server.request_parser import END, NEED_DATA, ParseError, RequestHead
from router.http.server.settings import ServerSettings, protocol_error

__all__ = ["RequestReader"]

# The interim answer to `Expect: 100-continue`.
_CONTINUE: Final = b"HTTP/1.1 100 \r\n\r\n"


class RequestReader:
    """Reads requests off one connection through its `ConnectionReader`."""

    __slots__ = ("_client", "_reader", "_settings", "_socket", "http_version", "method")

    def __init__(
        self,
        reader: ConnectionReader,
        socket: DirectSocket,
        settings: ServerSettings,
        client: tuple[str, int] | None,
    ) -> None:
        self._reader = reader
        self._socket = socket
        self._settings = settings
        self._client = client
        # The method of the request being read, once its head is in (a refusal of a HEAD
        # request has no body).
        self.method: bytes | None = None
        # The HTTP version of the last request read (its answer's framing depends on it).
        self.http_version = b"1.1"

    async def read(
        self, deadline: float | None, reservation: BodyReservation, *, shutting_down: bool
    ) -> Request | None:
        """The next request, head and whole body; None when the connection should close
        without an answer (the client left or reset, idle timeout, shutdown while idle).

        The body's bytes are taken from `reservation`, which the caller releases.
        Raises Refusal for a request to refuse.
        """
        self.method = None
        try:
            head = await self._read_head(deadline, shutting_down)
            if head is None:
                return None
            return await self._read_body(head, reservation)
        except ParseError as exc:
            self._keep_method()
            raise protocol_error(exc, self._settings) from None
        except Refusal:
            self._keep_method()
            raise
        except trio.BrokenResourceError:
            return None

    def _keep_method(self) -> None:
        """The method as far as the parser got, for a refusal. A method of its own, not
        `self.method or ...` in `read`: there mypy narrows `self.method` to None from the
        assignment at its top, across the awaits that set it, and the compiled build
        checks the value against that narrowed type."""
        if self.method is None:
            self.method = self._reader.parser.method

    async def _read_head(self, deadline: float | None, shutting_down: bool) -> RequestHead | None:
        """Wait for the next request head (its framing checked by the parser).

        `deadline` bounds the whole head (first request); None means a keep-alive wait: the
        idle timeout until a first byte, then the header timeout from that byte.
        """
        settings = self._settings
        reader = self._reader
        parser = reader.parser
        # What the parser already holds (a pipelined request) starts the head.
        buffered = parser.buffered
        event = parser.next_event()
        if event is NEED_DATA:
            waiting = not buffered
            if waiting and shutting_down:
                return None
            keep_alive_wait = deadline is None
            if deadline is None:
                timeout = settings.idle_timeout_s if waiting else settings.header_timeout_s
                deadline = clock.now() + timeout
            while event is NEED_DATA:
                reader.idle = waiting
                try:
                    arrived = await reader.receive(deadline)
                finally:
                    reader.idle = False
                if not arrived:
                    if not waiting:
                        raise ClientTooSlow("request headers took too long")
                    return None
                if waiting and keep_alive_wait:
                    deadline = clock.now() + settings.header_timeout_s
                waiting = False
                event = parser.next_event()
        if type(event) is not RequestHead:
            return None
        self.method = event.method
        self.http_version = event.http_version
        return event

    async def _read_body(self, head: RequestHead, reservation: BodyReservation) -> Request:
        """Check the head's limits, then read the whole body (413 past `max_body_bytes`,
        408 when it is not complete within `body_timeout_s` of the head)."""
        settings = self._settings
        limit = settings.max_body_bytes
        deadline = clock.now() + settings.body_timeout_s
        headers = head.headers
        # The parser bounds a head by its bytes; this bounds what it holds (lines without
        # their CRLFs and colons: close enough for a bound).
        head_bytes = len(head.method) + len(head.target)
        for name, value in headers:
            head_bytes += len(name) + len(value)
        if head_bytes > settings.max_header_bytes:
            raise HeadTooLarge(f"request headers exceed {settings.max_header_bytes} bytes")
        if head.content_length > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        if head.expects_continue:
            await self._socket.send_all(_CONTINUE, stall_timeout_s=settings.client_write_timeout_s)
        parser = self._reader.parser
        chunks: list[bytes] = []
        size = 0
        event = parser.next_event()
        while event is not END:
            if type(event) is bytes:
                size += len(event)
                if size > limit:
                    raise BodyTooLarge(f"request body exceeds {limit} bytes")
                # Taken as the bytes come, not as declared: a head alone must not be able
                # to hold the budget.
                reservation.take(len(event))
                chunks.append(event)
            elif not await self._reader.receive(deadline):
                raise ClientTooSlow(
                    f"request body not received within {settings.body_timeout_s:g}s"
                )
            event = parser.next_event()
        return Request(
            method=head.method.decode("latin-1"),
            target=head.target.decode("latin-1"),
            headers=headers,
            body=b"".join(chunks),
            client=self._client,
        )

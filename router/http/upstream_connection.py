"""One HTTP/1.1 client connection to a worker: a trio socket stream driven by h11.

This module is the edge where socket, trio and h11 exceptions become `UpstreamError`s;
nothing above it sees a `BrokenResourceError` or an `h11.RemoteProtocolError`. It knows
nothing of pooling: `router.http.pool` decides when a connection is opened, reused or
closed.
"""

from __future__ import annotations

import h11
import trio

_RECEIVE_SIZE = 65536

# What a worker (or the network) can do to an open connection. h11's LocalProtocolError is
# left out on purpose: it means our own request was malformed, a bug to see, not a worker
# fault to fail over from.
_TRANSPORT_ERRORS = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
    h11.RemoteProtocolError,
)

# States in which the worker has finished its message. ERROR is not among them: a body that
# broke off keeps raising, it never reads as a clean end.
_BODY_ENDED = frozenset((h11.DONE, h11.MUST_CLOSE, h11.CLOSED))


class UpstreamError(Exception):
    """The upstream exchange failed; `response_started` says whether any response byte arrived.

    Before the first response byte the request may be sent elsewhere; after it, the worker
    has begun to answer and the failure belongs to this attempt.
    """

    def __init__(self, message: str, *, response_started: bool = False) -> None:
        super().__init__(message)
        self.response_started = response_started


class UpstreamConnectError(UpstreamError):
    """No connection could be made: refused, unresolvable, unreachable, or a scheme we lack."""


class UpstreamProtocolError(UpstreamError):
    """The connection broke or the answer was not valid HTTP/1.1: reset, early EOF, garbage."""


class UpstreamConnection:
    """A connected socket stream and the h11 state machine that frames it.

    `idle_since` is written by the pool when the connection is returned to it.
    """

    __slots__ = ("_h11", "_stream", "idle_since", "response_started")

    def __init__(self, stream: trio.SocketStream) -> None:
        # trio's SocketStream turns TCP_NODELAY on for TCP sockets, which a request/response
        # protocol with small heads needs; nothing to set here.
        self._stream = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.response_started = False

    async def exchange(self, request: h11.Request, body: bytes) -> h11.Response:
        """Sends one request and waits for the final response head (1xx heads are skipped).

        Raises `UpstreamProtocolError` with `response_started` telling whether any response
        byte arrived. Cancellation: the connection is left mid-exchange; the caller must
        close it.
        """
        h = self._h11
        self.response_started = False
        try:
            head = h.send(request) or b""
            data = (h.send(h11.Data(data=body)) or b"") if body else b""
            tail = h.send(h11.EndOfMessage()) or b""
            # One write: with TCP_NODELAY, separate writes would be separate packets.
            await self._stream.send_all(b"".join((head, data, tail)))
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    await self._receive()
                elif isinstance(event, h11.Response):
                    return event
                elif not isinstance(event, h11.InformationalResponse):
                    raise UpstreamProtocolError(
                        f"upstream closed before answering ({type(event).__name__})",
                        response_started=self.response_started,
                    )
        except _TRANSPORT_ERRORS as exc:
            raise UpstreamProtocolError(
                _describe(exc, "before the response head"),
                response_started=self.response_started,
            ) from exc

    async def receive_data(self) -> bytes:
        """Returns the next body bytes as they arrive, b"" once the body has ended.

        Raises `UpstreamProtocolError` (response_started=True) on reset, early EOF or a
        malformed body. Cancellation: the connection is left mid-body; the caller must
        close it.
        """
        h = self._h11
        if h.their_state in _BODY_ENDED:
            return b""
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    await self._receive()
                elif isinstance(event, h11.Data):
                    if event.data:
                        # h11 hands out slices of its receive buffer (bytearray); callers
                        # get immutable bytes they may keep.
                        return bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return b""
                else:
                    raise UpstreamProtocolError(
                        f"unexpected {type(event).__name__} in the response body",
                        response_started=True,
                    )
        except _TRANSPORT_ERRORS as exc:
            raise UpstreamProtocolError(
                _describe(exc, "during the response body"), response_started=True
            ) from exc

    async def _receive(self) -> None:
        data = await self._stream.receive_some(_RECEIVE_SIZE)
        if data:
            self.response_started = True
        # b"" is end-of-stream; h11 turns it into ConnectionClosed or a RemoteProtocolError.
        self._h11.receive_data(data)

    def recycle(self) -> bool:
        """Readies the connection for the next request; False when it must not carry one.

        Only an exchange where both sides finished their message and neither asked to close
        (h11 leaves `MUST_CLOSE` for `connection: close` or HTTP/1.0) can be reused.
        """
        h = self._h11
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        """Closes the socket at once (no checkpoint), waking any task blocked on it.

        Unread data makes the kernel send a reset, which is what a half-read response
        deserves.
        """
        self._stream.socket.close()


def _describe(exc: BaseException, where: str) -> str:
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"upstream connection failed {where}: {type(exc).__name__}: {exc}"

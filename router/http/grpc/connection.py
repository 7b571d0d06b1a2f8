"""One HTTP/2 connection to one gRPC worker, carrying many calls at once, on trio.

The gRPC client is `h2` (the HTTP/2 state machine hypercorn and httpx use) on trio's own
sockets, with gRPC's five-byte message framing written here; the messages themselves are
the published protobuf classes (`smg-grpc-proto`), encoded by the callers. Why not
grpcio: its asyncio API runs only on asyncio, so under trio it needs trio-asyncio's
bridge, and the bridge costs per message several times what the whole client costs
here. Measured 2026-12-05 on this 2-core machine (`python -m bench.grpc_client`: client
CPU only, `Generate` streams from the fake gRPC engine, 32 calls in flight, 64 tokens
each; a real-engine benchmark ran beside it, hence the ranges of two runs): `h2` on trio
15.5-24.3 us per streamed message and 392-758 us per one-token call, 10,000 idle streams
held on one connection for +62 MiB and no CPU; grpcio's asyncio API under trio-asyncio
165-182 us and 1,385-1,419 us, and of 10,000 idle streams 2,013 cancelled by the server,
+323 MiB (docs/performance.md, "The gRPC upstream"). Nor does grpcio's blocking API
fit: it would take a thread per open stream.

A connection runs two tasks in the pool's nursery (`serve`): a reader that feeds the
socket's bytes to `h2` and hands each call its messages, and a writer that sends what
`h2` has queued whenever a call or the reader queued something. Every change to the `h2`
state is synchronous, so a call can be reset from a `finally` under cancellation without
awaiting anything.

Bounds: a call's received bytes are acknowledged to the worker (HTTP/2 flow control) only
as its reader takes its messages, so a call whose reader stalls holds at most one stream
window (64 KiB) here; a message longer than `max_message_bytes` ends the call.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from router.http.grpc.status import (
    GrpcBroken,
    GrpcError,
    GrpcProtocolError,
    GrpcStatusError,
    StatusCode,
    status_from_http,
)

__all__ = ["GrpcCall", "GrpcConnection", "frame_message"]

READ_SIZE = 65536
CONNECTION_WINDOW = 1 << 24
"""The connection's receive window: far above the sum of the streams' windows in use, so
a stalled call never holds up the others."""


def frame_message(payload: bytes) -> bytes:
    """One uncompressed gRPC message: flag, 4-byte big-endian length, the bytes."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class GrpcCall:
    """One call (one HTTP/2 stream): the request is sent with `send_message`, the answer
    read with `receive_message` until it gives None (status OK) or raises.

    `close` ends it from this side: a call still open is reset (CANCEL), which a gRPC
    server sees as the client's cancellation.
    """

    __slots__ = (
        "_arrived",
        "_buffer",
        "_connection",
        "_error",
        "_messages",
        "_unacked",
        "_window",
        "ended",
        "headers",
        "stream_id",
        "trailers",
    )

    def __init__(self, connection: GrpcConnection, stream_id: int) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self._buffer = bytearray()
        self._messages: deque[bytes] = deque()
        self._unacked = 0
        self._error: GrpcError | None = None
        self._arrived = trio.Event()
        self._window = trio.Event()
        self.ended = False
        """The worker ended the stream (or it failed): nothing more will arrive."""
        self.headers: dict[bytes, bytes] = {}
        self.trailers: dict[bytes, bytes] = {}

    async def send_message(self, payload: bytes, *, end: bool = True) -> None:
        """Send one message (and half-close the request with `end`), as fast as the
        worker's flow-control window lets it go."""
        connection = self._connection
        data = memoryview(frame_message(payload))
        while data:
            if self._error is not None:
                raise self._error
            window = connection.h2.local_flow_control_window(self.stream_id)
            size = min(window, connection.h2.max_outbound_frame_size, len(data))
            if size <= 0:
                await self._window.wait()
                self._window = trio.Event()
                continue
            last = size == len(data)
            try:
                connection.h2.send_data(self.stream_id, bytes(data[:size]), end_stream=end and last)
            except h2.exceptions.ProtocolError as exc:
                # The stream or the connection ended under us (a reset, a GOAWAY).
                raise GrpcBroken(f"{connection.label}: cannot send the request: {exc}") from None
            data = data[size:]
            connection.flush_soon()

    async def receive_message(self) -> bytes | None:
        """The next message of the answer; None once the call ended with status OK.

        Raises GrpcStatusError for another status, GrpcBroken when the connection broke,
        GrpcProtocolError for framing the client cannot read.
        """
        while True:
            if self._unacked:
                self._connection.acknowledge(self._unacked, self.stream_id)
                self._unacked = 0
            if self._messages:
                return self._messages.popleft()
            if self._error is not None:
                raise self._error
            if self.ended:
                return None
            await self._arrived.wait()
            self._arrived = trio.Event()

    def close(self) -> None:
        """Stop the call: reset the stream unless the worker already ended it. Synchronous,
        so it runs in any `finally`."""
        if not self.ended:
            self.ended = True
            self._connection.reset(self.stream_id)
        self._connection.forget(self.stream_id)

    # -- fed by the connection's reader -------------------------------------------------

    def _data(self, data: bytes, flow_controlled: int, max_message: int) -> None:
        self._unacked += flow_controlled
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 5:
            if buffer[0] != 0:
                self._fail(GrpcProtocolError("the worker sent a compressed message"))
                return
            length = int.from_bytes(buffer[1:5], "big")
            if length > max_message:
                self._fail(
                    GrpcProtocolError(
                        f"the worker sent a message of {length} bytes; the bound is {max_message}"
                    )
                )
                return
            if len(buffer) < 5 + length:
                break
            self._messages.append(bytes(buffer[5 : 5 + length]))
            del buffer[: 5 + length]
        self._arrived.set()

    def _response(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.headers = dict(headers)
        status = self.headers.get(b":status", b"")
        if status != b"200":
            code = status_from_http(int(status)) if status.isdigit() else StatusCode.UNKNOWN
            self._fail(
                GrpcStatusError(code, f"the worker answered HTTP {status.decode('latin-1')}")
            )

    def _end(self) -> None:
        """End of stream: the status is in the trailers, or in the headers of a
        trailers-only answer."""
        self.ended = True
        if self._error is None:
            source = self.trailers or self.headers
            status = source.get(b"grpc-status")
            if status is None:
                self._error = GrpcStatusError(
                    StatusCode.INTERNAL, "the worker ended the call without a grpc-status"
                )
            elif status != b"0":
                self._error = GrpcStatusError.from_trailers(status, source.get(b"grpc-message"))
            elif self._buffer:
                self._error = GrpcProtocolError("the worker ended the call inside a message")
        self._arrived.set()

    def _fail(self, error: GrpcError) -> None:
        if self._error is None:
            self._error = error
        if not self.ended:
            self.ended = True
            self._connection.reset(self.stream_id)
        self._arrived.set()
        self._window.set()

    def _window_opened(self) -> None:
        self._window.set()


class GrpcConnection:
    """The HTTP/2 connection to one worker and the calls open on it.

    `serve` runs it (in the pool's nursery) until the socket closes or breaks; every call
    still open then fails with GrpcBroken. After the worker's GOAWAY (or a broken socket)
    `accepting` is False and the pool opens a new connection for the next call.
    """

    def __init__(
        self, stream: trio.abc.Stream, authority: bytes, label: str, max_message_bytes: int
    ) -> None:
        self.stream = stream
        self.authority = authority
        self.label = label
        self.max_message_bytes = max_message_bytes
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config=config)
        self.h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
            },
        )
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW)
        self.calls: dict[int, GrpcCall] = {}
        self.accepting = True
        self.closed = False
        self.broken_by: str | None = None
        self._wake = trio.Event()
        self._wake.set()  # the preface and settings go out at once

    def open_call(self, path: bytes, metadata: Sequence[tuple[bytes, bytes]]) -> GrpcCall:
        """A new call's stream with its headers queued; its request follows with
        `GrpcCall.send_message`. Raises GrpcBroken when the connection takes no new call."""
        if not self.accepting:
            raise GrpcBroken(f"{self.label}: the connection takes no new calls", unprocessed=True)
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", self.authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *metadata,
        ]
        try:
            self.h2.send_headers(stream_id, headers)
        except h2.exceptions.TooManyStreamsError:
            raise GrpcBroken(
                f"{self.label}: the worker's limit of concurrent streams is reached",
                unprocessed=True,
            ) from None
        except h2.exceptions.ProtocolError as exc:
            self.accepting = False
            raise GrpcBroken(f"{self.label}: {exc}", unprocessed=True) from None
        call = GrpcCall(self, stream_id)
        self.calls[stream_id] = call
        self.flush_soon()
        return call

    @property
    def open_calls(self) -> int:
        return len(self.calls)

    def flush_soon(self) -> None:
        """Have the writer send what `h2` has queued."""
        self._wake.set()

    def acknowledge(self, size: int, stream_id: int) -> None:
        if self.closed:
            return
        try:
            self.h2.acknowledge_received_data(size, stream_id)
        except h2.exceptions.ProtocolError:
            return  # a stream (or connection) already over: its window no longer matters
        self.flush_soon()

    def reset(self, stream_id: int) -> None:
        if self.closed:
            return
        try:
            self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.ProtocolError:
            return  # already closed, or the connection is going away: nothing to reset
        self.flush_soon()

    def forget(self, stream_id: int) -> None:
        self.calls.pop(stream_id, None)

    async def serve(self) -> None:
        """Read and write until the connection ends; then every open call fails.

        Cancellation (the pool closing): the socket is closed and open calls fail with
        GrpcBroken.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, nursery.cancel_scope)
                await self._read()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            self.accepting = False
            why = self.broken_by or "the connection closed"
            for call in list(self.calls.values()):
                call._fail(GrpcBroken(f"{self.label}: {why}"))
            self.calls.clear()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    async def aclose(self) -> None:
        """Close the socket now (the reader then ends and fails what is open)."""
        self.accepting = False
        await trio.aclose_forcefully(self.stream)

    async def _write(self, connection_scope: trio.CancelScope) -> None:
        """Send what `h2` queued, whenever woken; a failed send ends the connection."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            data = self.h2.data_to_send()
            if data:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self.broken_by = self.broken_by or f"cannot send: {exc}"
                    connection_scope.cancel()
                    return

    async def _read(self) -> None:
        while True:
            try:
                data = await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.broken_by = self.broken_by or f"the connection broke: {exc}"
                return
            if not data:
                self.broken_by = "the worker closed the connection"
                return
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                self.broken_by = f"HTTP/2 error: {exc}"
                return
            for event in events:
                self._event(event)
            self.flush_soon()  # settings and ping acknowledgements, window updates

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            call = self.calls.get(event.stream_id)
            if call is None:
                # A stream this side already closed: its window still counts.
                self.acknowledge(event.flow_controlled_length, event.stream_id)
            else:
                call._data(event.data, event.flow_controlled_length, self.max_message_bytes)
        elif isinstance(event, h2.events.ResponseReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call._response(event.headers)
        elif isinstance(event, h2.events.TrailersReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.trailers = dict(event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call._end()
        elif isinstance(event, h2.events.StreamReset):
            call = self.calls.get(event.stream_id)
            if call is not None:
                refused = event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
                call._fail(
                    GrpcBroken(
                        f"{self.label} reset the call ({event.error_code!r})", unprocessed=refused
                    )
                )
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id == 0:
                for call in self.calls.values():
                    call._window_opened()
            else:
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call._window_opened()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.accepting = False
            last = event.last_stream_id if event.last_stream_id is not None else math.inf
            for stream_id, call in list(self.calls.items()):
                if stream_id > last:
                    call._fail(
                        GrpcBroken(f"{self.label} went away before the call", unprocessed=True)
                    )

"""The gRPC client against answers the fake engine never gives, from a small HTTP/2
server on loopback (h2's server side): a trailers-only status with a percent-encoded
message, an HTTP error status where gRPC was expected, a GOAWAY before the call was
processed, a compressed message, and a call that ends inside a message."""

from __future__ import annotations

from functools import partial

import h2.config
import h2.connection
import h2.events
import pytest
import trio

from router.http.grpc import (
    GrpcBroken,
    GrpcProtocolError,
    GrpcStatusError,
    StatusCode,
    open_grpc_pool,
)
from router.http.grpc.connection import frame_message

GUARD_S = 10
GRPC = (b"content-type", b"application/grpc")


async def _serve_one(stream: trio.SocketStream) -> None:
    """Answer each call by its path (see the module's docstring)."""
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    conn.initiate_connection()
    await stream.send_all(conn.data_to_send())
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        for event in conn.receive_data(data):
            if not isinstance(event, h2.events.RequestReceived):
                continue
            sid = event.stream_id
            path = dict(event.headers)[b":path"]
            if path == b"/t/trailers-only":
                headers = [(b":status", b"200"), GRPC, (b"grpc-status", b"5")]
                conn.send_headers(
                    sid, [*headers, (b"grpc-message", b"not%20here")], end_stream=True
                )
            elif path == b"/t/http-503":
                conn.send_headers(sid, [(b":status", b"503")], end_stream=True)
            elif path == b"/t/goaway":
                conn.close_connection(last_stream_id=0)
            elif path == b"/t/compressed":
                conn.send_headers(sid, [(b":status", b"200"), GRPC])
                conn.send_data(sid, b"\x01\x00\x00\x00\x01x")
            elif path == b"/t/cut":
                conn.send_headers(sid, [(b":status", b"200"), GRPC])
                conn.send_data(sid, frame_message(b"whole") + b"\x00\x00\x00\x00\x09part")
                conn.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
        await stream.send_all(conn.data_to_send())


@pytest.fixture
async def url(nursery: trio.Nursery) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, _serve_one, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"grpc://127.0.0.1:{port}"


async def test_a_trailers_only_status_is_read_with_its_message_decoded(url: str) -> None:
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            with pytest.raises(GrpcStatusError) as failed:
                await pool.unary(url, "/t/trailers-only", b"")
    assert (failed.value.code, failed.value.message) == (StatusCode.NOT_FOUND, "not here")


async def test_an_http_error_where_grpc_was_expected_maps_to_its_grpc_code(url: str) -> None:
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            with pytest.raises(GrpcStatusError) as failed:
                await pool.unary(url, "/t/http-503", b"")
    assert failed.value.code is StatusCode.UNAVAILABLE
    assert "HTTP 503" in failed.value.message


async def test_a_goaway_before_the_call_says_it_was_never_processed(url: str) -> None:
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            with pytest.raises(GrpcBroken) as broken:
                await pool.unary(url, "/t/goaway", b"")
            # The next call opens another connection.
            with pytest.raises(GrpcStatusError):
                await pool.unary(url, "/t/http-503", b"")
            stats = pool.statistics()
    assert broken.value.unprocessed
    assert stats.opened == 2


@pytest.mark.parametrize(
    ("path", "why"), [("/t/compressed", "compressed"), ("/t/cut", "inside a message")]
)
async def test_framing_the_client_cannot_read_is_a_protocol_error(
    url: str, path: str, why: str
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            async with pool.call(url, path, b"") as call:
                with pytest.raises(GrpcProtocolError, match=why):
                    while await call.receive_message() is not None:
                        pass

"""Slow clients at the client edge: a head or a body trickled a byte at a time is cut at
its deadline (408, connection closed, no worker reached), and a client that stops reading
its answer is dropped after `client_write_timeout_s` without progress, its upstream leg
cancelled and its lease released."""

from __future__ import annotations

import logging
import socket

import orjson
import pytest
import trio

from router.fake_worker.settings import FakeWorkerSettings
from tests.adversarial.support import (
    CHAT,
    CHAT_BODY,
    FOLLOW_UP,
    Setup,
    assert_still_serving,
    open_setup,
    statuses,
    workers_inflight,
)
from tests.support.http_client import read_until_closed
from tests.support.waiting import wait_until

GUARD_S = 30.0
# The trickle would last far longer than the guard: only the router's deadline ends it.
_TRICKLE_INTERVAL_S = 0.05
_HEAD = FOLLOW_UP[: FOLLOW_UP.index(b"\r\n\r\n") + 4]


async def _trickle(stream: trio.SocketStream, data: bytes, sent: list[int]) -> None:
    """Send `data` one byte every `_TRICKLE_INTERVAL_S` until the router stops taking it."""
    for index in range(len(data)):
        try:
            await stream.send_all(data[index : index + 1])
        except trio.BrokenResourceError:
            return
        sent[0] += 1
        await trio.sleep(_TRICKLE_INTERVAL_S)


async def _trickled_exchange(setup: Setup, prefix: bytes, trickled: bytes) -> tuple[bytes, int]:
    """Send `prefix` at once, then `trickled` byte by byte; the router's answer (read until
    it closes the connection) and how many trickled bytes it took."""
    sent = [0]
    stream = await trio.open_tcp_stream("127.0.0.1", setup.port)
    async with stream, trio.open_nursery() as nursery:
        await stream.send_all(prefix) if prefix else None
        nursery.start_soon(_trickle, stream, trickled, sent)
        answer = await read_until_closed(stream)
        nursery.cancel_scope.cancel()
    return answer, sent[0]


async def test_headers_trickled_byte_by_byte_are_cut_at_the_header_timeout() -> None:
    head = _HEAD + b"X-Pad: " + b"a" * 10_000 + b"\r\n\r\n"
    with trio.fail_after(GUARD_S):
        async with open_setup(header_timeout_s=1.0) as setup:
            answer, sent = await _trickled_exchange(setup, b"", head)
            assert statuses(answer) == [408]
            assert b"request headers took too long" in answer
            # 1 s at one byte per 50 ms: a few dozen bytes, nowhere near the whole head.
            assert sent < len(head) // 10
            assert setup.dispatches == 0
            await assert_still_serving(setup)


async def test_a_keep_alive_request_head_trickled_is_cut_at_the_header_timeout() -> None:
    with trio.fail_after(GUARD_S):
        async with open_setup(header_timeout_s=1.0) as setup:
            head = _HEAD + b"X-Pad: " + b"a" * 10_000 + b"\r\n\r\n"
            answer, sent = await _trickled_exchange(setup, FOLLOW_UP, head)
            assert statuses(answer) == [200, 408]
            assert sent < len(head) // 10
            assert setup.dispatches == 1
            await assert_still_serving(setup)


async def test_a_body_trickled_byte_by_byte_is_cut_at_the_body_timeout() -> None:
    """Each byte comes well within the header timeout: only a whole-body deadline ends it."""
    body = orjson.dumps({**CHAT, "pad": "a" * 10_000})
    head = _HEAD.replace(b"Content-Length: %d" % len(CHAT_BODY), b"Content-Length: %d" % len(body))
    with trio.fail_after(GUARD_S):
        async with open_setup(header_timeout_s=5.0, body_timeout_s=1.0) as setup:
            answer, sent = await _trickled_exchange(setup, head, body)
            assert statuses(answer) == [408]
            assert b"request body not received within 1s" in answer
            assert sent < len(body) // 10
            assert setup.dispatches == 0
            await assert_still_serving(setup)


async def test_a_chunked_body_trickled_is_cut_at_the_body_timeout() -> None:
    head = _HEAD.replace(b"Content-Length: %d" % len(CHAT_BODY), b"Transfer-Encoding: chunked")
    chunks = b"".join(b"1\r\n%s\r\n" % CHAT_BODY[i : i + 1] for i in range(len(CHAT_BODY)))
    with trio.fail_after(GUARD_S):
        async with open_setup(header_timeout_s=5.0, body_timeout_s=1.0) as setup:
            answer, _ = await _trickled_exchange(setup, head, chunks * 20)
            assert statuses(answer) == [408]
            assert setup.dispatches == 0
            await assert_still_serving(setup)


async def test_a_client_that_never_reads_is_dropped_and_its_upstream_leg_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream far larger than every socket buffer on the way, to a client that never
    calls recv: after `client_write_timeout_s` without progress the request ends as if the
    client had left, and one log line names the request that was cut."""
    request = orjson.dumps({**CHAT, "stream": True, "max_tokens": 1_000_000})
    data = FOLLOW_UP.replace(CHAT_BODY, request).replace(
        b"Content-Length: %d" % len(CHAT_BODY), b"Content-Length: %d" % len(request)
    )
    caplog.set_level(logging.WARNING, logger="router.failover")
    with trio.fail_after(GUARD_S):
        async with open_setup(
            FakeWorkerSettings(tokens=1_000_000), client_write_timeout_s=0.5
        ) as setup:
            pool = setup.router.app.generation.pool
            sock = trio.socket.socket()
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await sock.connect(("127.0.0.1", setup.port))
                await sock.send(data)
                # The worker streams until the router stops reading it: the router gave up on
                # the client, cancelled the leg, and the worker saw its connection close.
                await wait_until(lambda: setup.worker.worker.routing.disconnects == 1)
                # The router closed the client connection as well: what it had sent, then
                # end-of-stream (or a reset, for the bytes it never sent).
                received = 0
                try:
                    while chunk := await sock.recv(1 << 20):
                        received += len(chunk)
                except ConnectionResetError:
                    pass
                assert received < 1_000_000 * 50
            assert setup.dispatches == 1
            await wait_until(lambda: pool.statistics().in_use == 0)
            stats = pool.statistics()
            assert stats.idle_total == 0
            assert stats.closed == stats.opened == 1
            assert set((await workers_inflight(setup.router)).values()) == {0}
            await assert_still_serving(setup)
    cut = [r.getMessage() for r in caplog.records if "client-write-timeout-s" in r.getMessage()]
    assert len(cut) == 1
    assert cut[0].startswith("request ") and "took no byte for 0.5s" in cut[0]

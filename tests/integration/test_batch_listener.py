"""The listener takes every connection waiting in the kernel at one wake-up (bounded), and
closing it wakes a task waiting to accept."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from router.http.server.batch_listener import _BATCH, BatchListener
from router.http.server.listen import open_tcp_sockets

GUARD_S = 10.0


async def _listener() -> BatchListener:
    (sock,) = await open_tcp_sockets("127.0.0.1", 0)
    return BatchListener(sock)


def _connect(port: int, count: int) -> list[socket.socket]:
    # Blocking connects complete in the kernel's accept queue before any accept.
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


async def test_every_waiting_connection_is_taken_in_one_accept() -> None:
    listener = await _listener()
    clients = _connect(listener.port, 20)
    try:
        with trio.fail_after(GUARD_S):
            accepted = await listener.accept()
        assert len(accepted) == 20
        for conn in accepted:
            assert conn.getblocking() is False
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            conn.close()
    finally:
        for client in clients:
            client.close()
        listener.close()


async def test_one_accept_takes_at_most_a_batch() -> None:
    listener = await _listener()
    clients = _connect(listener.port, _BATCH + 5)
    try:
        with trio.fail_after(GUARD_S):
            first = await listener.accept()
            second = await listener.accept()
        assert (len(first), len(second)) == (_BATCH, 5)
        for conn in first + second:
            conn.close()
    finally:
        for client in clients:
            client.close()
        listener.close()


async def test_closing_wakes_a_waiting_accept() -> None:
    listener = await _listener()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:

            async def close_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                listener.close()

            nursery.start_soon(close_soon)
            with pytest.raises(trio.ClosedResourceError):
                await listener.accept()
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()

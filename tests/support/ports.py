"""Loopback ports for tests: free ones, refused ones, and ones whose connects hang."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio


def free_ports(count: int) -> list[int]:
    """Distinct ports nothing listens on right now (held together while chosen).

    For programs that cannot take port 0 (smg, etcd, a process group sharing one port),
    and for connects that must be refused. Another process could take one first, which
    shows as that program failing to start, never as a wrong answer.
    """
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


@asynccontextmanager
async def full_accept_queue() -> AsyncIterator[socket.socket]:
    """A listener whose one-slot accept queue is full, so the kernel drops further SYNs
    instead of refusing them (a worker behind a firewall looks the same): connects to it
    hang until it accepts one, and then complete on the kernel's next SYN (about 1 s)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        async with AsyncExitStack() as stack:
            held = 0
            # The kernel admits one connection beyond a zero backlog; fill until one hangs.
            while True:
                with trio.move_on_after(0.2) as probe:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    stack.push_async_callback(stream.aclose)
                    held += 1
                if probe.cancelled_caught:
                    break
                assert held < 16, "the accept queue never filled"
            yield listener


@asynccontextmanager
async def unanswered_port() -> AsyncIterator[int]:
    """A port whose connects hang (`full_accept_queue`)."""
    async with full_accept_queue() as listener:
        yield listener.getsockname()[1]

"""pyzmq under trio, without a thread per socket.

No thread per socket: trio waits on the socket's ZMQ_FD. That descriptor is not the
TCP socket; it is ZMQ's internal signalling fd, and it is edge-triggered: it becomes
readable when the socket's state *changes* (something arrived), and reading
ZMQ_EVENTS (or a recv) consumes the signal. If several messages arrived under one
edge and we read only one, the fd stays quiet while messages wait. So: check
ZMQ_EVENTS for POLLIN first, and receive while it is set; only wait on the fd when it
is clear. Any send or recv on the socket can also consume an edge, which is why the
check comes before every wait, not only after a wakeup.
"""

from __future__ import annotations

import trio
import zmq


def socket_fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's ZMQ_FD, the descriptor trio waits on."""
    fd = sock.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    return fd


async def recv_multipart(sock: zmq.Socket[bytes], fd: int) -> list[bytes]:
    """The next whole message, waiting on `fd` only while ZMQ_EVENTS has no POLLIN.

    Cancellation: the wait ends; a message taken in the step that was cancelled is
    dropped with it (callers cancel only when they are done with the socket).
    """
    while True:
        events = sock.getsockopt(zmq.EVENTS)
        assert isinstance(events, int)
        if events & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            await trio.lowlevel.checkpoint()
            return frames
        await trio.lowlevel.wait_readable(fd)


def close_socket(sock: zmq.Socket[bytes]) -> None:
    """Close at once (linger 0), waking first whatever waits on its fd; twice is harmless."""
    if sock.closed:
        return
    # Wake anything still waiting on the fd before it goes away (trio's rule).
    trio.lowlevel.notify_closing(socket_fd(sock))
    sock.close(linger=0)

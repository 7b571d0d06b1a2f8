"""A listening socket that takes every connection waiting in the kernel at each wake-up.

trio's `SocketListener.accept` takes one connection per scheduler pass: it yields after
each accept. With many connections arriving at once (a load balancer or a benchmark opening
256) while the process is busy serving the ones it has, the rest wait in the kernel's
accept queue one scheduler pass each, their requests already sent: that wait is the tail.
`BatchListener` waits for readability once, then accepts without yielding until the
queue is empty or `_BATCH` connections were taken.
"""

from __future__ import annotations

import errno
import socket
from typing import Final

import trio

__all__ = ["BatchListener"]

# Connections taken per wake-up at most, so one listener cannot hold the scheduler long.
_BATCH: Final = 64
_CLOSED_ERRNOS: Final = frozenset({errno.EBADF, errno.ENOTSOCK, errno.EINVAL})


class BatchListener:
    """Owns one listening socket (adopted from trio's); `close` wakes a waiting `accept`."""

    __slots__ = ("_closed", "sock")

    def __init__(self, listening: trio.socket.SocketType) -> None:
        self.sock = socket.socket(
            listening.family, listening.type, listening.proto, fileno=listening.detach()
        )
        self.sock.setblocking(False)
        self._closed = False

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def accept(self) -> list[socket.socket]:
        """The connections waiting (at least one, at most `_BATCH`), each non-blocking
        with TCP_NODELAY. Raises ClosedResourceError once closed, OSError when the system
        refuses (EMFILE and the like: what was taken before it is returned first)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            taken = self._take()
            if taken:
                # One yield per batch: the connections' tasks and the others get their turn.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return taken
            try:
                await trio.lowlevel.wait_readable(self.sock)
            except trio.ClosedResourceError:
                raise
            except OSError as exc:
                raise self._translate(exc) from exc

    def _take(self) -> list[socket.socket]:
        taken: list[socket.socket] = []
        while len(taken) < _BATCH:
            if self._closed:
                if taken:
                    break
                raise trio.ClosedResourceError("the listener was closed")
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if taken:
                    break
                raise self._translate(exc) from exc
            conn.setblocking(False)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass  # a connection already reset: its first read will say so
            taken.append(conn)
        return taken

    def _translate(self, exc: OSError) -> OSError | trio.ClosedResourceError:
        if self._closed or exc.errno in _CLOSED_ERRNOS:
            return trio.ClosedResourceError("the listener was closed")
        return exc

    def close(self) -> None:
        """Close at once (idempotent), waking a task waiting in `accept`."""
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

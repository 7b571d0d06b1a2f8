"""The one reader of a client connection's socket, and how the connection's task waits on it.

One reader task per connection does every read of the client socket. It reads only when
armed: by the connection's task when the parser needs bytes, and when a handler starts;
after delivering bytes the connection's task asked for, it reads on by itself (that task
will either ask for more or start a handler), which saves a wake-up per request. While the
handler runs, its pending read is the disconnect watch: end-of-stream means the client left
and cancels the handler; bytes mean a pipelined next request, kept in the parser's buffer for the
next cycle, and the reader then waits to be armed again. No task is started per request
(that cost a fifth of the router's CPU).
"""

from __future__ import annotations

import math
from typing import Final, Protocol

import trio

from router.http.direct_socket import DirectSocket
from router.http.server.messages import Request
from router.http.server.request_parser import RequestParser
from router.http.wait_deadlines import WaitDeadlines

__all__ = ["ConnectionReader", "Watch"]

_RECEIVE_BYTES: Final = 65536


class _Answer(Protocol):
    @property
    def ending(self) -> bool:
        """True once the response's last bytes are on their way."""
        ...


class Watch:
    """The handler the reader watches for a departing client: its request, its answer
    (end-of-stream once the answer is ending is a client done, not gone), its scope."""

    __slots__ = ("answer", "request", "scope")

    def __init__(self, request: Request, answer: _Answer, scope: trio.CancelScope) -> None:
        self.request = request
        self.answer = answer
        self.scope = scope


class ConnectionReader:
    """Feeds the request parser from the socket; `receive()` waits for the next bytes.

    `watch`: the handler running, while one runs. `idle`: set by the caller while it waits
    for the first byte of a next request (a closing server ends such a wait at once).
    `deadlines`: where each wait's deadline is kept (the server's; None: no deadline is
    ever due).
    """

    __slots__ = (
        "_armed",
        "_broken",
        "_deadlines",
        "_ended",
        "_main_waiter",
        "_parked",
        "_scope",
        "_socket",
        "_task",
        "_timed_out",
        "idle",
        "parser",
        "wait_deadline",
        "wait_number",
        "watch",
    )

    def __init__(
        self,
        socket: DirectSocket,
        parser: RequestParser,
        deadlines: WaitDeadlines | None = None,
    ) -> None:
        self._socket = socket
        self._deadlines = deadlines
        # The parser of the request being read; the connection swaps in a new one per request.
        self.parser = parser
        self._task: trio.lowlevel.Task | None = None
        self._scope = trio.CancelScope()
        self._armed = False
        self._parked = False
        self._broken: trio.BrokenResourceError | None = None
        self._ended = False
        self._main_waiter: trio.lowlevel.Task | None = None
        self._timed_out = False
        self.idle = False
        self.wait_deadline = math.inf
        """When the pending `receive` times out (`math.inf`: no wait pending, or none)."""
        self.wait_number = 0
        self.watch: Watch | None = None

    def stop(self) -> None:
        """Stop the reader task (it may already have stopped). No byte is lost."""
        self._scope.cancel()

    async def run(self) -> None:
        """The connection's only reader of the client socket, one read per arming.

        What a read brings goes to the parser's buffer: a request's bytes, or a pipelined next
        request while a handler runs (the reader then stops until armed again, so a later
        disconnect shows as a failed send). End-of-stream while a handler runs, before the
        response's last bytes went out, means the client left: the handler is cancelled. A
        client that closes once the whole response is on its way is done, not gone: the
        handler's bookkeeping after the response is left to finish.
        Cancellation: stops at once; no byte is lost (a pending read consumed nothing).
        """
        self._task = trio.lowlevel.current_task()
        with self._scope:
            while True:
                if not self._armed:
                    self._parked = True
                    await trio.lowlevel.wait_task_rescheduled(self._abort_park)
                try:
                    data = await self._socket.receive_some(_RECEIVE_BYTES)
                except trio.BrokenResourceError as exc:
                    data = b""
                    self._broken = exc
                watch = self.watch
                waiter = self._main_waiter
                # Bytes the connection's task asked for, read while no handler runs: it will
                # parse them and then either run a handler (whose disconnect watch is this
                # next read) or ask for more, so the reader reads on without being armed
                # again. Anything else (a pipelined request while a handler runs) parks it:
                # one read per arming bounds what it buffers.
                self._armed = bool(data) and waiter is not None and watch is None
                if watch is None or data:
                    if data or self._broken is None:
                        self.parser.receive_data(data)
                elif watch.answer.ending:
                    self.parser.receive_data(b"")
                else:
                    watch.request.client_gone = True
                    watch.scope.cancel()
                if waiter is not None:
                    self._main_waiter = None
                    trio.lowlevel.reschedule(waiter)
                if not data:
                    self._ended = True
                    return

    @property
    def ended(self) -> bool:
        """True once the reader saw end-of-stream (or a reset) and stopped."""
        return self._ended

    def _abort_park(self, _: object) -> trio.lowlevel.Abort:
        self._parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    def arm(self) -> None:
        """Let the reader make its next read (the disconnect watch, while a handler runs)."""
        self._armed = True
        if self._parked:
            self._parked = False
            assert self._task is not None
            trio.lowlevel.reschedule(self._task)

    async def receive(self, deadline: float = math.inf) -> bool:
        """Wait until the reader gave the parser more bytes, or end-of-stream: True; False
        when `deadline` passed first, or `expire()` ended the wait.

        The deadline is kept by the server's `WaitDeadlines`, not in a cancel scope (one
        per wait cost a twentieth of a request). Raises BrokenResourceError when the client
        reset the connection. Cancellation (the connection's scope, the shutdown grace
        over) and time-outs: the reader's read stays pending; what it brings still goes to
        the parser.
        """
        self._raise_if_reset()
        self.arm()
        self._main_waiter = trio.lowlevel.current_task()
        self._timed_out = False
        self.wait_number += 1
        self.wait_deadline = deadline
        deadlines = self._deadlines
        if deadlines is not None:
            deadlines.waiting(self)
        try:
            await trio.lowlevel.wait_task_rescheduled(self._abort_main_wait)
        finally:
            self.wait_deadline = math.inf
            if deadlines is not None:
                deadlines.done(self)
        if self._timed_out:
            return False
        self._raise_if_reset()
        return True

    def _raise_if_reset(self) -> None:
        """Raise BrokenResourceError once the reader saw the client's reset.

        A method of its own so that each call reads the attribute afresh: within `receive`,
        a test before the wait would narrow it to None for the test after it, and the
        compiled build would then refuse the reset the reader task stored meanwhile.
        """
        if self._broken is not None:
            raise trio.BrokenResourceError("the client reset the connection")

    def expire(self) -> None:
        """End the pending `receive` (its deadline passed, or the server closes idle
        connections); nothing when none is pending or bytes already ended it."""
        waiter = self._main_waiter
        if waiter is not None:
            self._main_waiter = None
            self._timed_out = True
            trio.lowlevel.reschedule(waiter)

    def _abort_main_wait(self, _: object) -> trio.lowlevel.Abort:
        self._main_waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

"""The outbound connection pool: per-worker idle HTTP/1.1 connections, O(1) per request.

Each worker (keyed by its base URL) has a deque of idle connections used as a LIFO stack:
checkout pops the most recently returned connection, return appends it. The freshest
connection is the one least likely to have been closed by the worker, and the oldest
gather at the left end, where the periodic sweep closes them before the engine's own
keep-alive timeout does. No request ever walks the pooled connections.

A connection goes back to the pool only after a response read to its end, on HTTP/1.1, with
no `connection: close` and no byte beyond the response. Anything else (an error, a cancellation, a
body left unread) closes it.

A request is never sent twice by the pool. A pooled connection is checked at checkout,
before anything is written: one non-blocking peek tells whether the worker closed it (or
sent bytes nobody asked for) while it was idle, and such a connection is discarded. Once a
request is written, any failure is the caller's: the worker may have read the request and
started working on it, and a generation is not idempotent.

Each worker's open connections are capped (`max_connections_per_worker`); a checkout
beyond the cap waits in line (FIFO) for a returned connection or a freed slot, no longer
than its connect timeout, and then raises `LocalShortage`: a local overload, not a fault
of the worker. So does a connect that fails for want of a local resource (`EMFILE`, ...).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Final, Protocol

import trio

from router.http import clock
from router.http.upstream.connection import (
    UpstreamConnection,
    UpstreamConnectTimeout,
    UpstreamResponse,
    ip_literal_family,
    open_upstream_connection,
)
from router.http.upstream.connection_slots import ConnectionSlots, SlotWaitTimeout
from router.http.upstream.exceptions import (
    POOL_WAIT_KIND,
    LocalShortage,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from router.http.upstream.request_encoding import encode_request
from router.http.upstream.worker_url import parse_worker_url
from router.http.wait_deadlines import WaitDeadlines

__all__ = [
    "LocalShortage",
    "PoolSettings",
    "PoolStatistics",
    "PooledRequest",
    "UpstreamAnswer",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamRequests",
    "UpstreamResponse",
    "UpstreamTimeout",
    "open_upstream_pool",
]


class UpstreamAnswer(Protocol):
    """What the request pipeline reads of a worker's response (an `UpstreamResponse`):
    typed so for the reason `UpstreamRequests` is."""

    status: int
    headers: list[tuple[bytes, bytes]]

    def receive_some(self, deadline: float = math.inf) -> Awaitable[bytes]: ...

    def body_ended(self) -> bool: ...

    def abandon(self) -> None: ...

    def take_whole_body(self) -> bytes | None: ...


class UpstreamRequests(Protocol):
    """What the request pipeline asks of the pool: one request to a worker. The pipeline
    takes this, not `UpstreamPool`, so that a test can hand it a scripted pool: the
    compiled build (setup.py) checks a class's type wherever one is passed, never a
    Protocol's."""

    def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout_s: float | None = None,
        head_deadline: float = math.inf,
    ) -> AbstractAsyncContextManager[UpstreamAnswer]: ...


@dataclass(frozen=True, slots=True)
class PoolSettings:
    max_idle_per_worker: int = 256
    """Idle connections kept per worker; a connection returned beyond it is closed."""
    idle_expiry_s: float = 4.0
    """Idle connections older than this are closed (uvicorn closes idle ones after 5 s)."""
    sweep_interval_s: float = 1.0
    max_connections_per_worker: int = 256
    """Open connections per worker (connecting, in use and idle); checkouts beyond it wait."""


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    idle_per_worker: dict[str, int]
    idle_total: int
    in_use: int
    """Connections checked out by a request right now."""
    opened: int
    closed: int
    reused: int
    """Checkouts served from the pool."""
    stale_discarded: int
    """Pooled connections found closed (or unexpectedly readable) at checkout, before any
    request was written on them, and discarded."""
    waiting: int
    """Checkouts waiting in line for a worker at its connection cap."""
    local_errors: dict[str, int]
    """Checkouts refused for want of a local resource, by kind (`emfile`, ...,
    `pool_wait_timeout`)."""


DEFAULT_POOL_SETTINGS: Final = PoolSettings()


class _Endpoint:
    """One worker's address, parsed once, and its idle connections (oldest on the left)."""

    __slots__ = ("base_url", "family", "host", "host_header", "idle", "port", "prefix", "slots")

    def __init__(self, base_url: str, max_connections: int) -> None:
        # Worker records are validated with the same rules when parsed, so a URL refused
        # here (InvalidWorkerUrl, a ValueError) reached the pool some other way: a bug on
        # our side, not a worker fault to fail over from.
        address = parse_worker_url(base_url)
        if address.protocol != "http":
            raise ValueError(f"{base_url} is a gRPC worker: the HTTP pool cannot send to it")
        self.base_url = base_url
        self.host = address.host
        self.family = ip_literal_family(address.host)
        self.port = address.port
        self.host_header = address.host_header
        self.prefix = address.prefix
        self.idle: deque[UpstreamConnection] = deque()
        self.slots: ConnectionSlots[UpstreamConnection] = ConnectionSlots(max_connections)


class PooledRequest:
    """What `UpstreamPool.request` returns: `async with` it to get the `UpstreamResponse`.

    A plain class rather than a generator-based context manager: it is entered once per
    proxied request.
    """

    __slots__ = (
        "_pool",
        "base_url",
        "body",
        "connect_timeout_s",
        "connection",
        "endpoint",
        "head_deadline",
        "headers",
        "method",
        "target",
    )

    def __init__(
        self,
        pool: UpstreamPool,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        connect_timeout_s: float | None,
        head_deadline: float,
    ) -> None:
        self._pool = pool
        self.base_url = base_url
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.connect_timeout_s = connect_timeout_s
        self.head_deadline = head_deadline
        self.endpoint: _Endpoint | None = None
        self.connection: UpstreamConnection | None = None

    async def __aenter__(self) -> UpstreamResponse:
        return await self._pool._open(self)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        connection = self.connection
        assert connection is not None and self.endpoint is not None
        self.connection = None
        self._pool._finish(self.endpoint, connection, failed=exc_type is not None)


class UpstreamPool:
    """Idle HTTP/1.1 connections per worker, checked out and returned in O(1).

    The pool keeps one deadline, the response head's, when a request gives one (its own
    timer's on pooled connections); any other timeout is the caller's (`trio.move_on_after`
    / `fail_after`), and a cancellation anywhere closes the connection it hit.
    """

    def __init__(self, settings: PoolSettings = DEFAULT_POOL_SETTINGS) -> None:
        self._settings = settings
        # close_idle() sets this to 0 so that connections still checked out are closed on
        # return instead of landing in a pool nobody sweeps.
        self._max_idle = settings.max_idle_per_worker
        # One entry per worker URL in use; `forget()` drops a departed worker's entry once
        # no request holds it (a request holds its endpoint across the exchange).
        self._endpoints: dict[str, _Endpoint] = {}
        self._in_use = 0
        self._opened = 0
        self._closed = 0
        self._reused = 0
        self._stale_discarded = 0
        self._local_errors: dict[str, int] = {}
        # The head deadlines of exchanges on pooled connections (run by `open_upstream_pool`).
        self.deadlines = WaitDeadlines()

    def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout_s: float | None = None,
        head_deadline: float = math.inf,
    ) -> PooledRequest:
        """An async context manager that sends one request to `base_url` and gives the
        response once its head arrived.

        `host` and `content-length` are set here; `headers` are forwarded as given and must
        carry neither, nor `transfer-encoding`. A pooled connection the worker closed while
        idle is discarded at checkout, before the request is written; once written, the
        request is never sent again by the pool, whatever happens.
        On exit the connection returns to the pool only if the body was read to its end
        (`receive_some` gave b"", or `read()`) and the worker keeps it alive.
        `connect_timeout_s` bounds opening a new connection (past it,
        `UpstreamConnectTimeout`), and separately the wait for a connection when the worker
        is at its connection cap (past it, `LocalShortage`). Any deadline on the whole
        exchange stays the caller's, but for `head_deadline`, by which the response head
        must have arrived (connecting or waiting at the cap included): past it,
        `UpstreamTimeout`, the connection closed. On a pooled connection the deadline is
        the pool's timer's (`router.http.wait_deadlines`: no cancel scope per request);
        when the request must wait or connect first, or no timer runs, a cancel scope's.
        Raises `UpstreamConnectError` / `UpstreamProtocolError`, `LocalShortage` (the
        router's own trouble, not the worker's), and ValueError for a URL or request
        HTTP/1.1 cannot carry (before any connection is touched).
        Cancellation: the connection in use is closed, the pool stays consistent.
        """
        return PooledRequest(
            self, base_url, method, target, headers, body, connect_timeout_s, head_deadline
        )

    async def _open(self, request: PooledRequest) -> UpstreamResponse:
        """`PooledRequest.__aenter__`: checkout (or connect) and the exchange up to the head."""
        base_url = request.base_url
        endpoint = self._endpoints.get(base_url)
        if endpoint is None:
            endpoint = self._endpoints[base_url] = _Endpoint(
                base_url, self._settings.max_connections_per_worker
            )
        # Built (and validated) before any connection is touched, so a malformed request
        # costs no connection.
        data = encode_request(
            request.method,
            endpoint.prefix + request.target,
            endpoint.host_header,
            request.headers,
            request.body,
        )
        connection, status, response_headers = await self._start(
            endpoint,
            data,
            request.method == "HEAD",
            request.connect_timeout_s,
            request.head_deadline,
        )
        self._in_use += 1
        request.endpoint = endpoint
        request.connection = connection
        return UpstreamResponse(connection, status, response_headers)

    def _finish(self, endpoint: _Endpoint, connection: UpstreamConnection, failed: bool) -> None:
        """`PooledRequest.__aexit__`: back to the pool, or closed."""
        self._in_use -= 1
        idle = endpoint.idle
        if failed or not connection.recycle():
            self._close(endpoint, connection)
        elif endpoint.slots.offer(connection):
            pass  # handed to the first checkout waiting at the cap
        elif len(idle) < self._max_idle:
            connection.idle_since = clock.now()
            idle.append(connection)
        else:
            self._close(endpoint, connection)

    async def _start(
        self,
        endpoint: _Endpoint,
        data: bytes,
        bodyless: bool,
        connect_timeout_s: float | None,
        head_deadline: float,
    ) -> tuple[UpstreamConnection, int, list[tuple[bytes, bytes]]]:
        """Runs the exchange up to the response head on a pooled or a fresh connection.

        The request is written once. Cancellation: the connection in use is closed.
        """
        connection = self._take_idle(endpoint)
        if connection is not None and (head_deadline == math.inf or self.deadlines.serving):
            # The common case: a pooled connection, its deadline kept by the pool's timer.
            try:
                status, headers = await connection.exchange(
                    data, bodyless=bodyless, deadline=head_deadline, deadlines=self.deadlines
                )
            except BaseException:
                self._close(endpoint, connection)
                raise
            return connection, status, headers
        return await self._start_slowly(
            endpoint, connection, data, bodyless, connect_timeout_s, head_deadline
        )

    async def _start_slowly(
        self,
        endpoint: _Endpoint,
        connection: UpstreamConnection | None,
        data: bytes,
        bodyless: bool,
        connect_timeout_s: float | None,
        head_deadline: float,
    ) -> tuple[UpstreamConnection, int, list[tuple[bytes, bytes]]]:
        """`_start` when it must connect or wait at the cap first (or no timer runs): the
        whole of it under one cancel scope at the head's deadline."""
        with trio.CancelScope(deadline=head_deadline) as scope:
            if connection is None:
                connection = await self._checkout_new(endpoint, connect_timeout_s)
            try:
                status, headers = await connection.exchange(
                    data, bodyless=bodyless, deadlines=self.deadlines
                )
            except BaseException:
                self._close(endpoint, connection)
                raise
            return connection, status, headers
        assert scope.cancelled_caught
        raise UpstreamTimeout(
            f"no response head from {endpoint.base_url} by the deadline (connecting or waiting "
            "for a connection)"
        )

    async def _checkout_new(
        self, endpoint: _Endpoint, timeout_s: float | None
    ) -> UpstreamConnection:
        """With no live idle connection: a new one, else (at the cap) one handed over in
        turn.

        Cancellation: nothing is left taken; a slot or connection handed over meanwhile
        goes to the next in line.
        """
        slots = endpoint.slots
        if not slots.try_take():
            wait_s = math.inf if timeout_s is None else timeout_s
            try:
                handed = await slots.wait(wait_s, partial(self._close, endpoint))
            except SlotWaitTimeout:
                raise self._local_error(
                    POOL_WAIT_KIND,
                    f"no connection to {endpoint.base_url} freed within {wait_s:g}s: "
                    f"all {slots.cap} are in use",
                ) from None
            if handed is not None:
                if handed.peer_is_silent():
                    self._reused += 1
                    return handed
                self._stale_discarded += 1
                handed.close()  # its slot stays taken: this checkout connects with it
                self._closed += 1
        try:
            return await self._connect(endpoint, timeout_s)
        except BaseException:
            slots.release()
            raise

    def _take_idle(self, endpoint: _Endpoint) -> UpstreamConnection | None:
        """The freshest idle connection still fit to carry a request, or None.

        Expired ones are closed (the freshest expired means every older one did too; each
        is closed once: amortised O(1)); one the worker closed, or wrote to, while idle is
        discarded before anything was written on it.
        """
        idle = endpoint.idle
        expiry_s = self._settings.idle_expiry_s
        while idle:
            connection = idle.pop()
            if clock.now() - connection.idle_since >= expiry_s:
                self._close(endpoint, connection)
                while idle:
                    self._close(endpoint, idle.pop())
                return None
            if connection.peer_is_silent():
                self._reused += 1
                return connection
            self._stale_discarded += 1
            self._close(endpoint, connection)
        return None

    async def _connect(self, endpoint: _Endpoint, timeout_s: float | None) -> UpstreamConnection:
        """A new connection (see `open_upstream_connection`), its local shortages counted."""
        try:
            connection = await open_upstream_connection(
                endpoint.host, endpoint.port, endpoint.base_url, timeout_s, endpoint.family
            )
        except LocalShortage as exc:
            self._local_errors[exc.kind] = self._local_errors.get(exc.kind, 0) + 1
            raise
        self._opened += 1
        return connection

    def _local_error(self, kind: str, message: str) -> LocalShortage:
        self._local_errors[kind] = self._local_errors.get(kind, 0) + 1
        return LocalShortage(kind, message)

    def _close(self, endpoint: _Endpoint, connection: UpstreamConnection) -> None:
        """Closes a connection counted against `endpoint`'s cap and frees its slot."""
        connection.close()
        self._closed += 1
        endpoint.slots.release()

    def sweep(self, now: float) -> int:
        """Closes idle connections that have been idle for `idle_expiry_s` or more at `now`.

        Walks each worker's deque from its oldest end and stops at the first fresh one, so
        the cost is the number of connections closed plus one per worker. Returns how many
        were closed.
        """
        oldest_kept = now - self._settings.idle_expiry_s
        closed = 0
        for endpoint in self._endpoints.values():
            idle = endpoint.idle
            while idle and idle[0].idle_since <= oldest_kept:
                self._close(endpoint, idle.popleft())
                closed += 1
        return closed

    async def serve_sweeper(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Sweeps expired idle connections every `sweep_interval_s` until cancelled.

        Cancellation: stops between sweeps; the pool is left as it was.
        """
        task_status.started()
        while True:
            await trio.sleep(self._settings.sweep_interval_s)
            self.sweep(clock.now())

    def statistics(self) -> PoolStatistics:
        idle_per_worker = {
            url: len(endpoint.idle) for url, endpoint in self._endpoints.items() if endpoint.idle
        }
        return PoolStatistics(
            idle_per_worker=idle_per_worker,
            idle_total=sum(idle_per_worker.values()),
            in_use=self._in_use,
            opened=self._opened,
            closed=self._closed,
            reused=self._reused,
            stale_discarded=self._stale_discarded,
            waiting=sum(endpoint.slots.waiting for endpoint in self._endpoints.values()),
            local_errors=dict(self._local_errors),
        )

    def forget(self, base_url: str) -> bool:
        """Drop the endpoint of a worker that left the fleet and close its idle connections.

        Call it once no request to `base_url` is in flight: a connection in use would come
        back to the dropped endpoint. Returns whether the pool held anything for it.
        """
        endpoint = self._endpoints.pop(base_url, None)
        if endpoint is None:
            return False
        while endpoint.idle:
            self._close(endpoint, endpoint.idle.pop())
        return True

    def close_idle(self) -> None:
        """Closes every idle connection and stops pooling: connections still in use are
        closed when their request ends."""
        self._max_idle = 0
        for endpoint in self._endpoints.values():
            idle = endpoint.idle
            while idle:
                self._close(endpoint, idle.pop())

    async def aclose(self) -> None:
        """As `close_idle`. Cancellation: everything is closed before the checkpoint."""
        self.close_idle()
        await trio.lowlevel.checkpoint()


def open_upstream_pool(settings: PoolSettings = DEFAULT_POOL_SETTINGS) -> OpenedPool:
    """A pool with its sweeper running in a nursery owned here, for `async with`: on exit
    the sweeper stops and every connection is closed (those still in use when their
    request ends)."""
    return OpenedPool(UpstreamPool(settings))


class OpenedPool:
    """`open_upstream_pool`'s context manager. A class with `__aenter__`/`__aexit__` around
    the nursery's own, not an `@asynccontextmanager` generator: this module is compiled
    with mypyc, which compiles no async generators (docs/performance.md, "The compiled
    build")."""

    __slots__ = ("_manager", "_nursery", "pool")

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self._manager = trio.open_nursery()
        self._nursery: trio.Nursery | None = None

    async def __aenter__(self) -> UpstreamPool:
        nursery = self._nursery = await self._manager.__aenter__()
        try:
            await nursery.start(self.pool.serve_sweeper)
            await nursery.start(self.pool.deadlines.serve)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self.pool

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        self.pool.close_idle()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        return bool(await self._manager.__aexit__(exc_type, exc, traceback))

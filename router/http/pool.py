"""The outbound connection pool: per-worker idle HTTP/1.1 connections, O(1) per request.

Each worker (keyed by its base URL) has a deque of idle connections used as a LIFO stack:
checkout pops the most recently returned connection, return appends it. The freshest
connection is the one least likely to have been closed by the worker, and the oldest
gather at the left end, where the periodic sweep closes them before the engine's own
keep-alive timeout does. No request ever walks the pooled connections.

A connection goes back to the pool only after a response read to its end, on HTTP/1.1, with
no `connection: close` and no byte beyond the response. Anything else (an error, a cancellation, a
body left unread) closes it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

import trio

from router.http.upstream_connection import (
    UpstreamConnectError,
    UpstreamConnection,
    UpstreamError,
    UpstreamProtocolError,
    encode_request,
)

__all__ = [
    "PoolSettings",
    "PoolStatistics",
    "PooledRequest",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "open_upstream_pool",
]


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection was made within the caller's connect deadline."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    max_idle_per_worker: int = 64
    """Idle connections kept per worker; a connection returned beyond it is closed."""
    idle_expiry_s: float = 4.0
    """Idle connections older than this are closed (uvicorn closes idle ones after 5 s)."""
    sweep_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    idle_per_worker: dict[str, int]
    idle_total: int
    in_use: int
    """Connections checked out by a request right now."""
    opened: int
    closed: int
    reused: int
    """Checkouts served from the pool (including those that turned out stale)."""
    stale_retries: int
    """Pooled connections that failed before any response byte, retried on a fresh one."""


class _Endpoint:
    """One worker's address, parsed once, and its idle connections (oldest on the left)."""

    __slots__ = ("base_url", "host", "host_header", "idle", "port", "prefix")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme == "https":
            raise UpstreamConnectError(
                f"https upstreams are not supported by the native pool: {base_url!r}"
            )
        try:
            port = parts.port or 80
        except ValueError as exc:
            raise UpstreamConnectError(f"bad port in upstream URL {base_url!r}") from exc
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamConnectError(f"not an http://host[:port] URL: {base_url!r}")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = port
        self.host_header = parts.netloc.rpartition("@")[2].encode("ascii")
        self.prefix = parts.path.rstrip("/")
        self.idle: deque[UpstreamConnection] = deque()


class UpstreamResponse:
    """A response whose head has arrived; the body is read on demand."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(
        self, connection: UpstreamConnection, status: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._connection = connection
        self.status = status
        self.headers = headers

    async def receive_some(self) -> bytes:
        """The next body bytes as they arrive; b"" once the body has ended.

        Raises `UpstreamProtocolError` (response_started=True) when the body breaks off.
        Cancellation: the request's context manager closes the connection.
        """
        return await self._connection.receive_data()

    async def read(self) -> bytes:
        """The whole remaining body. Errors and cancellation as `receive_some`."""
        chunks = []
        while chunk := await self._connection.receive_data():
            chunks.append(chunk)
        return b"".join(chunks)


class PooledRequest:
    """What `UpstreamPool.request` returns: `async with` it to get the `UpstreamResponse`.

    A plain class rather than a generator-based context manager: it is entered once per
    proxied request.
    """

    __slots__ = (
        "_pool", "base_url", "body", "connect_timeout_s", "connection", "endpoint", "headers",
        "method", "target",
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
    ) -> None:
        self._pool = pool
        self.base_url = base_url
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.connect_timeout_s = connect_timeout_s
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

    The pool sets no timeouts: callers wrap requests in `trio.move_on_after` /
    `fail_after`, and a cancellation anywhere closes the connection it hit.
    """

    def __init__(self, settings: PoolSettings = PoolSettings()) -> None:
        self._settings = settings
        # close_idle() sets this to 0 so that connections still checked out are closed on
        # return instead of landing in a pool nobody sweeps.
        self._max_idle = settings.max_idle_per_worker
        # Endpoints are never dropped: a request holds its endpoint across the exchange,
        # and one small entry per worker URL ever seen is cheap.
        self._endpoints: dict[str, _Endpoint] = {}
        self._in_use = 0
        self._opened = 0
        self._closed = 0
        self._reused = 0
        self._stale_retries = 0

    def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout_s: float | None = None,
    ) -> PooledRequest:
        """An async context manager that sends one request to `base_url` and gives the
        response once its head arrived.

        `host` and `content-length` are set here; `headers` are forwarded as given and must
        carry neither, nor `transfer-encoding`. A pooled connection that fails before any
        response byte (the worker closed it while idle) is retried once on a fresh one.
        On exit the connection returns to the pool only if the body was read to its end
        (`receive_some` gave b"", or `read()`) and the worker keeps it alive.
        `connect_timeout_s` bounds opening a new connection only (a pooled one needs no
        connect): past it, `UpstreamConnectTimeout`. Any deadline on the whole exchange
        stays the caller's.
        Raises `UpstreamConnectError` / `UpstreamProtocolError`, and ValueError for a
        request HTTP/1.1 cannot carry (before any connection is touched).
        Cancellation: the connection in use is closed, the pool stays consistent.
        """
        return PooledRequest(self, base_url, method, target, headers, body, connect_timeout_s)

    async def _open(self, request: PooledRequest) -> UpstreamResponse:
        """`PooledRequest.__aenter__`: checkout (or connect) and the exchange up to the head."""
        base_url = request.base_url
        endpoint = self._endpoints.get(base_url)
        if endpoint is None:
            endpoint = self._endpoints[base_url] = _Endpoint(base_url)
        # Built (and validated) before any connection is touched, so a malformed request
        # costs no connection, and reused as-is for the stale retry.
        data = encode_request(
            request.method, endpoint.prefix + request.target, endpoint.host_header,
            request.headers, request.body,
        )
        connection, status, response_headers = await self._start(
            endpoint, data, request.method == "HEAD", request.connect_timeout_s
        )
        self._in_use += 1
        request.endpoint = endpoint
        request.connection = connection
        return UpstreamResponse(connection, status, response_headers)

    def _finish(self, endpoint: _Endpoint, connection: UpstreamConnection, failed: bool) -> None:
        """`PooledRequest.__aexit__`: back to the pool, or closed."""
        self._in_use -= 1
        idle = endpoint.idle
        if not failed and len(idle) < self._max_idle and connection.recycle():
            connection.idle_since = trio.current_time()
            idle.append(connection)
        else:
            self._close(connection)

    async def _start(
        self, endpoint: _Endpoint, data: bytes, bodyless: bool, connect_timeout_s: float | None
    ) -> tuple[UpstreamConnection, int, list[tuple[bytes, bytes]]]:
        """Runs the exchange up to the response head on a pooled or a fresh connection.

        Cancellation: the connection in use is closed.
        """
        idle = endpoint.idle
        if idle:
            connection = idle.pop()
            if trio.current_time() - connection.idle_since < self._settings.idle_expiry_s:
                self._reused += 1
                try:
                    return connection, *await connection.exchange(data, bodyless=bodyless)
                except UpstreamProtocolError as exc:
                    self._close(connection)
                    if exc.response_started:
                        raise
                    self._stale_retries += 1
                except BaseException:
                    self._close(connection)
                    raise
            else:
                # The freshest idle connection outlived the expiry, so every older one did
                # too; the sweep has not run yet. Each is closed once: amortised O(1).
                self._close(connection)
                while idle:
                    self._close(idle.pop())
        connection = await self._connect(endpoint, connect_timeout_s)
        try:
            return connection, *await connection.exchange(data, bodyless=bodyless)
        except BaseException:
            self._close(connection)
            raise

    async def _connect(self, endpoint: _Endpoint, timeout_s: float | None) -> UpstreamConnection:
        """A new connection to `endpoint`, within `timeout_s` when given.

        Cancellation: any half-made connection is closed by trio; nothing is counted.
        """
        # A connect that hangs (a SYN dropped by a full backlog or a firewall) would
        # otherwise eat the whole first-byte deadline, which is sized for a slow prefill,
        # not for a worker that is not there.
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as deadline:
            try:
                stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
            except OSError as exc:
                raise UpstreamConnectError(f"cannot connect to {endpoint.base_url}: {exc}") from exc
        if deadline.cancelled_caught:
            raise UpstreamConnectTimeout(
                f"cannot connect to {endpoint.base_url}: no connection within {timeout_s:g}s"
            )
        self._opened += 1
        return UpstreamConnection(stream)

    def _close(self, connection: UpstreamConnection) -> None:
        connection.close()
        self._closed += 1

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
                self._close(idle.popleft())
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
            self.sweep(trio.current_time())

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
            stale_retries=self._stale_retries,
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
            self._close(endpoint.idle.pop())
        return True

    def close_idle(self) -> None:
        """Closes every idle connection and stops pooling: connections still in use are
        closed when their request ends."""
        self._max_idle = 0
        for endpoint in self._endpoints.values():
            idle = endpoint.idle
            while idle:
                self._close(idle.pop())

    async def aclose(self) -> None:
        """As `close_idle`. Cancellation: everything is closed before the checkpoint."""
        self.close_idle()
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def open_upstream_pool(
    settings: PoolSettings = PoolSettings(),
) -> AsyncIterator[UpstreamPool]:
    """A pool with its sweeper running in a nursery owned here; on exit the sweeper stops
    and every connection is closed (those still in use when their request ends)."""
    pool = UpstreamPool(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve_sweeper)
        try:
            yield pool
        finally:
            pool.close_idle()
            nursery.cancel_scope.cancel()

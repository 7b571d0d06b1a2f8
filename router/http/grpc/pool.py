"""The gRPC upstream pool: one HTTP/2 connection per worker, many calls on it, bounded.

A worker (keyed by its `grpc://host:port` URL) has at most one live connection; the first
call opens it and every call after shares it, each on a stream of its own. The
connection's tasks run in the pool's nursery (`open_grpc_pool`), never in a request's: a
request that ends or is cancelled closes only its own stream. A connection the worker
closed, broke or sent GOAWAY on takes no new calls, and the next call opens another.

Calls in flight per worker are capped (`max_calls_per_worker`); a call beyond the cap
waits for one to end, no longer than its connect timeout, then raises `LocalShortage`
(the router's trouble, not the worker's), as the HTTP pool does at its connection cap.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType

import trio

from router.http.grpc.connection import GrpcCall, GrpcConnection
from router.http.grpc.status import GrpcConnectError, GrpcProtocolError
from router.http.upstream.exceptions import POOL_WAIT_KIND, LocalShortage
from router.http.upstream.worker_url import parse_worker_url

__all__ = ["GrpcPool", "GrpcPoolSettings", "GrpcPoolStatistics", "open_grpc_pool"]

log = logging.getLogger("router.grpc")


@dataclass(frozen=True, slots=True)
class GrpcPoolSettings:
    max_calls_per_worker: int = 256
    """Calls open at once on one worker's connection; calls beyond it wait their turn
    (`router serve` sets it from `--max-connections-per-worker`)."""
    max_message_bytes: int = 16 * 1024 * 1024
    """The largest message taken from a worker (a whole unary answer of a long
    generation is far below it)."""
    connect_timeout_s: float = 5.0
    """For calls that name none (facts, health checks)."""


@dataclass(frozen=True, slots=True)
class GrpcPoolStatistics:
    connections: int
    """Connections open now (at most one per worker that takes calls)."""
    opened: int
    closed: int
    calls_open: int
    calls_waiting: int
    """Calls waiting in line at a worker's call cap."""


class _Endpoint:
    __slots__ = ("authority", "connecting", "connection", "host", "limiter", "port", "url")

    def __init__(self, url: str, max_calls: int) -> None:
        address = parse_worker_url(url)
        if address.protocol != "grpc":
            raise ValueError(f"{url} is not a grpc:// worker URL")
        self.url = url
        self.host = address.host
        self.port = address.port
        self.authority = address.host_header
        self.connection: GrpcConnection | None = None
        self.connecting: trio.Lock = trio.Lock()
        self.limiter = trio.Semaphore(max_calls)


class GrpcPool:
    """Connections to gRPC workers, owned by `nursery` (see `open_grpc_pool`)."""

    def __init__(self, nursery: trio.Nursery, settings: GrpcPoolSettings) -> None:
        self._nursery = nursery
        self.settings = settings
        self._endpoints: dict[str, _Endpoint] = {}
        self._opened = 0
        self._closed = 0
        self._calls_open = 0
        self._waiting = 0

    def call(
        self,
        url: str,
        method: str,
        request: bytes,
        metadata: Sequence[tuple[bytes, bytes]] = (),
        *,
        connect_timeout_s: float | None = None,
    ) -> PooledCall:
        """An async context manager: the call of `method` (`/package.Service/Method`) on
        `url`'s worker with its one request message sent, giving the `GrpcCall` to read
        the answer from. On exit a call not read to its end is reset (the worker sees a
        cancellation). Raises GrpcConnectError when no connection could be made within
        `connect_timeout_s`, LocalShortage at the call cap past the same wait, ValueError
        for a URL that is not `grpc://`. Any deadline on the answer is the caller's.
        Cancellation: the stream is reset; the connection stays for the other calls.
        """
        timeout_s = (
            self.settings.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        )
        return PooledCall(self, url, method.encode("ascii"), request, metadata, timeout_s)

    async def unary(
        self,
        url: str,
        method: str,
        request: bytes,
        metadata: Sequence[tuple[bytes, bytes]] = (),
        *,
        connect_timeout_s: float | None = None,
    ) -> bytes:
        """A unary call's one answer message; raises as `call`, and GrpcStatusError for
        any status but OK (GrpcProtocolError for an answer that is not one message)."""
        async with self.call(
            url, method, request, metadata, connect_timeout_s=connect_timeout_s
        ) as call:
            answer = await call.receive_message()
            if answer is None or await call.receive_message() is not None:
                raise GrpcProtocolError(f"{url}{method} did not answer with one message")
            return answer

    async def _open(self, pooled: PooledCall) -> GrpcCall:
        endpoint = self._endpoints.get(pooled.url)
        if endpoint is None:
            endpoint = self._endpoints[pooled.url] = _Endpoint(
                pooled.url, self.settings.max_calls_per_worker
            )
        with trio.move_on_after(pooled.connect_timeout_s) as waited:
            self._waiting += 1
            try:
                await endpoint.limiter.acquire()
            finally:
                self._waiting -= 1
        if waited.cancelled_caught:
            raise LocalShortage(
                POOL_WAIT_KIND,
                f"no call to {pooled.url} ended within {pooled.connect_timeout_s:g}s: "
                f"all {self.settings.max_calls_per_worker} are open",
            )
        pooled.endpoint = endpoint
        try:
            connection = await self._connection(endpoint, pooled.connect_timeout_s)
            call = connection.open_call(pooled.method, pooled.metadata)
            pooled.call = call
            self._calls_open += 1
            await call.send_message(pooled.request)
        except BaseException:
            self._finish(pooled)
            raise
        return call

    def _finish(self, pooled: PooledCall) -> None:
        call, endpoint = pooled.call, pooled.endpoint
        pooled.call = pooled.endpoint = None
        if call is not None:
            call.close()
            self._calls_open -= 1
        if endpoint is not None:
            endpoint.limiter.release()

    async def _connection(self, endpoint: _Endpoint, timeout_s: float) -> GrpcConnection:
        """The worker's live connection, else a new one (one connect at a time per
        worker; the others wait for it)."""
        connection = endpoint.connection
        if connection is not None and connection.accepting:
            return connection
        async with endpoint.connecting:
            connection = endpoint.connection
            if connection is not None and connection.accepting:
                return connection
            with trio.move_on_after(timeout_s) as deadline:
                try:
                    stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
                except OSError as exc:
                    raise GrpcConnectError(
                        f"cannot connect to {endpoint.url}: {exc.strerror or exc}"
                    ) from None
            if deadline.cancelled_caught:
                raise GrpcConnectError(f"cannot connect to {endpoint.url} within {timeout_s:g}s")
            connection = GrpcConnection(
                stream, endpoint.authority, endpoint.url, self.settings.max_message_bytes
            )
            endpoint.connection = connection
            self._opened += 1
            self._nursery.start_soon(self._serve, endpoint, connection)
            return connection

    async def _serve(self, endpoint: _Endpoint, connection: GrpcConnection) -> None:
        """Run one connection in the pool's nursery. A bug in handling one worker's bytes
        ends that connection (its calls fail), never the pool and every other worker's."""
        try:
            await connection.serve()
        except Exception:
            log.exception("the gRPC connection to %s failed", endpoint.url)
        finally:
            self._closed += 1
            if endpoint.connection is connection:
                endpoint.connection = None

    def forget(self, url: str) -> bool:
        """Close the connection of a worker that left the fleet (its open calls fail);
        returns whether the pool held one."""
        endpoint = self._endpoints.pop(url, None)
        if endpoint is None or endpoint.connection is None:
            return False
        self._nursery.start_soon(endpoint.connection.aclose)
        return True

    def statistics(self) -> GrpcPoolStatistics:
        return GrpcPoolStatistics(
            connections=sum(
                1 for endpoint in self._endpoints.values() if endpoint.connection is not None
            ),
            opened=self._opened,
            closed=self._closed,
            calls_open=self._calls_open,
            calls_waiting=self._waiting,
        )


class PooledCall:
    """What `GrpcPool.call` returns: `async with` it to get the `GrpcCall`."""

    __slots__ = (
        "_pool",
        "call",
        "connect_timeout_s",
        "endpoint",
        "metadata",
        "method",
        "request",
        "url",
    )

    def __init__(
        self,
        pool: GrpcPool,
        url: str,
        method: bytes,
        request: bytes,
        metadata: Sequence[tuple[bytes, bytes]],
        connect_timeout_s: float,
    ) -> None:
        self._pool = pool
        self.url = url
        self.method = method
        self.request = request
        self.metadata = metadata
        self.connect_timeout_s = connect_timeout_s if connect_timeout_s > 0 else math.inf
        self.call: GrpcCall | None = None
        self.endpoint: _Endpoint | None = None

    async def __aenter__(self) -> GrpcCall:
        return await self._pool._open(self)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._pool._finish(self)


@asynccontextmanager
async def open_grpc_pool(
    settings: GrpcPoolSettings = GrpcPoolSettings(),
) -> AsyncIterator[GrpcPool]:
    """A pool whose connections run in a nursery owned here; on exit every connection is
    closed and the calls still open fail."""
    async with trio.open_nursery() as nursery:
        pool = GrpcPool(nursery, settings)
        try:
            yield pool
        finally:
            nursery.cancel_scope.cancel()

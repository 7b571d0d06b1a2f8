"""Connections to a plane: a pool that knows what became of each request on the wire.

A plane may close a keep-alive connection right after an answer without saying so:
smg answers a 401 off the request's headers alone, leaves the body unread and closes
(observed with a body written after the headers, as httpx writes it). A client that
offers that connection its next request meets the close and reports an error the plane
never made. Two rules keep the runner from turning that into a verdict:

- an answer that said or implied close retires its connection: `connection: close`
  (h11 already closes then), and an error status to a request that carried a body,
  which the server may have answered before reading it;
- a request that went out on a reused connection and met the peer's close before a
  single byte of an answer came back is one the plane cannot have processed, so
  `conformance.client` sends it once more, on a new connection, and says so. Nothing
  else is resent: not a request on a connection opened for it, not one that received
  any byte, not a timeout.

What happened to a request is kept in an `Exchange` held in a context variable of the
task that sends it: httpcore opens connections and reads answers in the requesting task.
"""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import httpcore
import httpx

# httpcore's errors as httpx's, most specific first: the first match wins.
ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)
# The errors by which a peer's close shows; a timeout is not one (the plane may be busy).
CLOSED_BY_PEER: tuple[type[httpx.HTTPError], ...] = (
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


@dataclass(slots=True)
class Exchange:
    """One request's life on the wire, as far as the pool saw it."""

    opened_connection: bool = False  # the request's own connection, not a pooled one
    bytes_received: int = 0  # of the answer, headers included

    def unprocessed(self, exc: httpx.HTTPError) -> bool:
        """The peer closed a reused connection before any byte of an answer: it cannot
        have acted on the request, so sending it again is safe."""
        return (
            isinstance(exc, CLOSED_BY_PEER)
            and not self.opened_connection
            and self.bytes_received == 0
        )


_EXCHANGE: ContextVar[Exchange | None] = ContextVar("conformance_exchange", default=None)


@contextmanager
def watch_exchange() -> Iterator[Exchange]:
    """Record what the pool does for the requests made inside this block (one at a
    time, in this task)."""
    exchange = Exchange()
    token = _EXCHANGE.set(exchange)
    try:
        yield exchange
    finally:
        _EXCHANGE.reset(token)


# The two classes below implement httpcore's network interface, whose methods take
# `timeout` by name (hence the ASYNC109 exemptions).
class _WatchedStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self.retired = False

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        data = await self._inner.read(max_bytes, timeout)
        exchange = _EXCHANGE.get()
        if exchange is not None:
            exchange.bytes_received += len(data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: typing.Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        return _WatchedStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        # httpcore drops an idle connection whose socket reads as readable (the peer's
        # close is waiting there): a retired one reads so before its next request.
        if info == "is_readable" and self.retired:
            return True
        return self._inner.get_extra_info(info)


class _WatchedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        exchange = _EXCHANGE.get()
        if exchange is not None:
            exchange.opened_connection = True
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _WatchedStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.UnsupportedProtocol("planes are reached over TCP")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except tuple(source for source, _ in ERRORS) as exc:
        target = next(target for source, target in ERRORS if isinstance(exc, source))
        raise target(str(exc)) from exc


class _Body(httpx.AsyncByteStream):
    def __init__(self, inner: typing.AsyncIterable[bytes]) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped():
            async for part in self._inner:
                yield part

    async def aclose(self) -> None:
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            with _mapped():
                await close()


def implies_close(request: httpx.Request, status: int, headers: httpx.Headers) -> bool:
    """Whether an answer leaves its connection unfit for another request: it says
    `connection: close`, or it is an error to a request with a body, which the server
    may have sent before reading that body (and then closes without a word)."""
    if "close" in headers.get("connection", "").lower():
        return True
    has_body = request.headers.get("content-length", "0") != "0" or (
        "transfer-encoding" in request.headers
    )
    return status >= 400 and has_body


class PlaneTransport(httpx.AsyncBaseTransport):
    """httpx's HTTP/1.1 transport over httpcore's pool, with the two rules above."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_WatchedBackend(),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _mapped():
            answer = await self._pool.handle_async_request(core_request)
        assert isinstance(answer.stream, typing.AsyncIterable)
        response = httpx.Response(
            status_code=answer.status,
            headers=answer.headers,
            stream=_Body(answer.stream),
            extensions=answer.extensions,
        )
        stream = answer.extensions.get("network_stream")
        if isinstance(stream, _WatchedStream) and implies_close(
            request, response.status_code, response.headers
        ):
            stream.retired = True
        return response

    async def aclose(self) -> None:
        await self._pool.aclose()


@asynccontextmanager
async def open_plane_client(
    limits: httpx.Limits | None = None, timeout_s: float = 10.0
) -> AsyncIterator[httpx.AsyncClient]:
    """The client the runner reaches planes and fake workers with."""
    limits = limits or httpx.Limits(max_connections=500, max_keepalive_connections=100)
    transport = PlaneTransport(limits)
    async with httpx.AsyncClient(transport=transport, trust_env=False, timeout=timeout_s) as client:
        yield client

"""The upstream pool against real loopback servers: reuse, bounds, expiry and failures.

Every count asserted here is a cost: connections opened, reused, closed, retried, and what
the server saw.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from socket import AF_INET

import pytest
import trio
import trio.testing

from router.http.upstream.connection import (
    UpstreamConnection,
    UpstreamConnectTimeout,
    ip_literal_family,
    open_upstream_connection,
)
from router.http.upstream.exceptions import (
    LocalShortage,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from router.http.upstream.pool import PoolSettings, UpstreamPool, open_upstream_pool
from router.http.upstream.worker_url import InvalidWorkerUrl
from tests.support.ports import full_accept_queue, unanswered_port
from tests.support.raw_upstream import Exchange, RawUpstream, Respond, open_raw_upstream
from tests.support.waiting import wait_until

GUARD_S = 10


async def ok(exchange: Exchange) -> None:
    """Answers 200 with the connection id, so tests can tell connections apart."""
    await exchange.respond(200, [(b"x-connection", b"%d" % exchange.connection_id)], b"ok")


@asynccontextmanager
async def pool_and_upstream(
    respond: Respond = ok, settings: PoolSettings | None = None
) -> AsyncIterator[tuple[UpstreamPool, RawUpstream]]:
    async with open_raw_upstream(respond) as upstream:
        pool = UpstreamPool(settings or PoolSettings())
        try:
            yield pool, upstream
        finally:
            await pool.aclose()


async def get(pool: UpstreamPool, upstream: RawUpstream) -> bytes:
    """One GET read to the end; returns the connection id the server answered on."""
    async with pool.request(upstream.url, "GET", "/", [], b"") as response:
        assert response.status == 200
        await response.read()
        return dict(response.headers)[b"x-connection"]


async def test_keep_alive_reuses_one_connection() -> None:
    seen: list[Exchange] = []

    async def echo(exchange: Exchange) -> None:
        seen.append(exchange)
        await exchange.respond(200, [(b"x-connection", b"1")], exchange.body.upper())

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(echo) as (pool, upstream):
            for body in (b"first", b"second"):
                async with pool.request(
                    upstream.url + "/", "POST", "/v1/x?y=1", [(b"x-test", b"1")], body
                ) as response:
                    assert response.status == 200
                    assert (b"content-length", b"%d" % len(body)) in response.headers
                    assert await response.read() == body.upper()

            stats = pool.statistics()
            assert (stats.opened, stats.reused, stats.closed, stats.in_use) == (1, 1, 0, 0)
            assert stats.idle_per_worker == {upstream.url + "/": 1}
            assert (upstream.accepted, upstream.requests) == (1, 2)
            request = seen[0].request
            assert (request.method, request.target) == (b"POST", b"/v1/x?y=1")
            assert seen[0].header(b"host") == b"127.0.0.1:%d" % upstream.port
            assert seen[0].header(b"content-length") == b"5"
            assert seen[0].header(b"x-test") == b"1"
            assert [e.body for e in seen] == [b"first", b"second"]


async def test_idle_connections_are_reused_last_in_first_out() -> None:
    with trio.fail_after(GUARD_S):
        async with pool_and_upstream() as (pool, upstream):
            async with AsyncExitStack() as stack:
                outer = await stack.enter_async_context(
                    pool.request(upstream.url, "GET", "/", [], b"")
                )
                inner = await stack.enter_async_context(
                    pool.request(upstream.url, "GET", "/", [], b"")
                )
                for response in (outer, inner):
                    await response.read()
                assert pool.statistics().in_use == 2
            # The stack returned `inner` first, then `outer`: `outer` is the freshest.
            headers_outer, headers_inner = dict(outer.headers), dict(inner.headers)
            assert await get(pool, upstream) == headers_outer[b"x-connection"]
            async with pool.request(upstream.url, "GET", "/", [], b"") as held:
                await held.read()
                assert await get(pool, upstream) == headers_inner[b"x-connection"]

            stats = pool.statistics()
            assert (stats.opened, stats.reused, stats.closed) == (2, 3, 0)


async def test_burst_keeps_at_most_the_bound_and_closes_the_rest() -> None:
    arrived = 0
    all_in = trio.Event()

    async def hold_until_all_arrive(exchange: Exchange) -> None:
        nonlocal arrived
        arrived += 1
        if arrived == 100:
            all_in.set()
        await all_in.wait()
        await ok(exchange)

    with trio.fail_after(GUARD_S):
        settings = PoolSettings(max_idle_per_worker=8)
        async with pool_and_upstream(hold_until_all_arrive, settings) as (pool, upstream):
            async with trio.open_nursery() as nursery:
                for _ in range(100):
                    nursery.start_soon(get, pool, upstream)
            await upstream.wait_ended(92)

            stats = pool.statistics()
            assert (stats.opened, stats.idle_total, stats.closed, stats.in_use) == (100, 8, 92, 0)
            assert (upstream.accepted, upstream.ended) == (100, 92)


async def test_sweep_closes_from_the_oldest_end_and_stops_at_the_first_fresh() -> None:
    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(settings=PoolSettings(idle_expiry_s=4.0)) as (
            pool,
            upstream,
        ):
            async with pool.request(upstream.url, "GET", "/", [], b"") as kept:
                async with pool.request(upstream.url, "GET", "/", [], b"") as expiring:
                    await expiring.read()
                    before = trio.current_time()
                between = trio.current_time()
                await kept.read()
            # `expiring` went idle in [before, between], `kept` after `between`.

            assert pool.sweep(before + 4.0 - 0.001) == 0
            assert pool.sweep(between + 4.0) == 1
            assert pool.statistics().idle_total == 1
            await upstream.wait_ended(1)
            assert await get(pool, upstream) == dict(kept.headers)[b"x-connection"]
            assert pool.sweep(trio.current_time() + 4.0) == 1

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total) == (2, 2, 0)
            assert stats.idle_per_worker == {}


async def test_sweeper_of_open_upstream_pool_closes_idle_connections() -> None:
    settings = PoolSettings(idle_expiry_s=0.05, sweep_interval_s=0.01)
    with trio.fail_after(GUARD_S):
        async with open_raw_upstream(ok) as upstream, open_upstream_pool(settings) as pool:
            before = trio.current_time()
            await get(pool, upstream)
            assert pool.statistics().idle_total == 1
            await upstream.wait_ended(1)
            assert trio.current_time() - before >= 0.05

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total) == (1, 1, 0)


async def test_expired_connection_is_not_handed_out_before_the_sweep() -> None:
    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(settings=PoolSettings(idle_expiry_s=0.0)) as (
            pool,
            upstream,
        ):
            assert await get(pool, upstream) == b"1"
            assert await get(pool, upstream) == b"2"

            stats = pool.statistics()
            assert (stats.opened, stats.reused, stats.closed, stats.idle_total) == (2, 0, 1, 1)


@pytest.mark.parametrize("hang_up", [Exchange.close, Exchange.reset])
async def test_pooled_connection_closed_while_idle_is_discarded_before_writing(
    hang_up: Callable[[Exchange], None],
) -> None:
    async def answer_then_hang_up(exchange: Exchange) -> None:
        await ok(exchange)
        hang_up(exchange)

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(answer_then_hang_up) as (pool, upstream):
            assert await get(pool, upstream) == b"1"
            await upstream.wait_ended(1)  # the worker closed the idle connection
            assert await get(pool, upstream) == b"2"

            stats = pool.statistics()
            # Detected at checkout: nothing was written on it, so nothing was sent twice.
            assert (stats.opened, stats.reused, stats.stale_discarded, stats.closed) == (2, 0, 1, 1)
            assert (upstream.accepted, upstream.requests) == (2, 2)


async def test_pooled_connection_with_unasked_bytes_is_discarded() -> None:
    returned = trio.Event()
    babbled = trio.Event()

    async def answer_then_babble(exchange: Exchange) -> None:
        await ok(exchange)
        if exchange.index == 0:
            await returned.wait()
            await exchange.send_raw(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            babbled.set()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(answer_then_babble) as (pool, upstream):
            assert await get(pool, upstream) == b"1"
            assert pool.statistics().idle_total == 1
            returned.set()
            await babbled.wait()
            await trio.sleep(0.05)  # real time: the stray bytes cross loopback
            assert await get(pool, upstream) == b"2"
            stats = pool.statistics()
            assert (stats.opened, stats.stale_discarded) == (2, 1)


async def test_pooled_connection_failing_after_the_write_is_never_resent() -> None:
    """The worker reads the whole request, works 200 ms, and closes without a word: it
    may have started the generation, so the pool must not send it again."""

    async def first_ok_then_read_and_vanish(exchange: Exchange) -> None:
        if exchange.index == 0:
            await ok(exchange)
            return
        await trio.sleep(0.2)
        exchange.close()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(first_ok_then_read_and_vanish) as (pool, upstream):
            assert await get(pool, upstream) == b"1"
            with pytest.raises(UpstreamProtocolError) as caught:
                await get(pool, upstream)
            assert caught.value.response_started is False

            stats = pool.statistics()
            assert (stats.opened, stats.reused, stats.stale_discarded, stats.closed) == (1, 1, 0, 1)
            # Received once; the error is the caller's to count as an attempt.
            assert (upstream.accepted, upstream.requests) == (1, 2)


@pytest.mark.parametrize("hang_up", [Exchange.close, Exchange.reset])
async def test_fresh_connection_failure_is_not_retried(
    hang_up: Callable[[Exchange], None],
) -> None:
    async def hang_up_without_answer(exchange: Exchange) -> None:
        hang_up(exchange)

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(hang_up_without_answer) as (pool, upstream):
            with pytest.raises(UpstreamProtocolError) as caught:
                await get(pool, upstream)
            assert caught.value.response_started is False

            stats = pool.statistics()
            assert (stats.opened, stats.stale_discarded, stats.closed, stats.in_use) == (1, 0, 1, 0)
            assert upstream.requests == 1


async def test_pooled_connection_failing_after_a_response_byte_is_not_retried() -> None:
    async def then_half_a_head(exchange: Exchange) -> None:
        if exchange.index == 0:
            await ok(exchange)
        else:
            await exchange.send_raw(b"HTTP/1.1 200 OK\r\ncontent-le")
            exchange.close()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(then_half_a_head) as (pool, upstream):
            await get(pool, upstream)
            with pytest.raises(UpstreamProtocolError) as caught:
                await get(pool, upstream)
            assert caught.value.response_started is True

            stats = pool.statistics()
            assert (stats.opened, stats.reused, stats.stale_discarded, stats.closed) == (1, 1, 0, 1)
            assert upstream.requests == 2


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_refused_connection_raises_connect_error() -> None:
    """The refused socket is closed at once, not left to the collector."""
    # A bound socket that never listens: the port is ours and connecting to it is refused.
    with socket.socket() as bound, trio.fail_after(GUARD_S):
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        pool = UpstreamPool()
        descriptors = _open_descriptors()
        with pytest.raises(UpstreamConnectError) as caught:
            async with pool.request(url, "GET", "/", [], b""):
                pytest.fail("no response expected")
        assert caught.value.response_started is False
        assert _open_descriptors() == descriptors

        stats = pool.statistics()
        assert (stats.opened, stats.closed, stats.in_use) == (0, 0, 0)


class WaitsForWritable:
    """Counts the connects that waited for their socket to become writable (and waits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self._real = trio.lowlevel.wait_writable
        monkeypatch.setattr(trio.lowlevel, "wait_writable", self)

    async def __call__(self, sock: socket.socket) -> None:
        self.calls += 1
        await self._real(sock)


async def test_a_connect_done_within_the_call_goes_on_without_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Toward the same host the handshake is over when `connect` returns: no wake-up spent."""
    waits = WaitsForWritable(monkeypatch)
    with trio.fail_after(GUARD_S):
        async with pool_and_upstream() as (pool, upstream):
            await get(pool, upstream)
            assert pool.statistics().opened == 1
    assert waits.calls == 0


async def test_a_connect_still_under_way_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SYN dropped by a full accept queue: the connect waits, and completes once the
    queue has room and the kernel sends the SYN again (about a second later)."""
    waits = WaitsForWritable(monkeypatch)
    with trio.fail_after(GUARD_S):
        async with full_accept_queue() as listener, AsyncExitStack() as accepted:
            port = listener.getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            made: list[UpstreamConnection] = []

            async def connect() -> None:
                made.append(await open_upstream_connection("127.0.0.1", port, url, None, AF_INET))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(connect)
                await trio.testing.wait_all_tasks_blocked()
                assert (waits.calls, made) == (1, [])
                listener.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    while True:  # room in the queue for the SYN sent again
                        accepted.callback(listener.accept()[0].close)
        assert len(made) == 1
        made[0].close()
    assert waits.calls == 1


async def test_connect_timeout_bounds_a_hanging_connect() -> None:
    """An IP literal's connect, cancelled by the connect timeout, leaves no socket open."""
    with trio.fail_after(GUARD_S):
        async with unanswered_port() as port:
            pool = UpstreamPool()
            descriptors = _open_descriptors()
            started = trio.current_time()
            with pytest.raises(
                UpstreamConnectTimeout, match=r"no connection within 0\.3s"
            ) as caught:
                async with pool.request(
                    f"http://127.0.0.1:{port}", "GET", "/", [], b"", connect_timeout_s=0.3
                ):
                    pytest.fail("no response expected")
            waited = trio.current_time() - started
            assert isinstance(caught.value, UpstreamConnectError)
            assert caught.value.response_started is False
            assert 0.3 <= waited < 2
            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.in_use) == (0, 0, 0)
            assert _open_descriptors() == descriptors


@pytest.mark.parametrize(
    ("host", "family"),
    [
        ("127.0.0.1", socket.AF_INET),
        ("::1", socket.AF_INET6),
        ("fe80::1", socket.AF_INET6),
        ("localhost", None),
        ("worker-0.engines.svc", None),
        ("127.1", None),  # getaddrinfo's shorthand, not a literal ipaddress reads: resolved
    ],
)
def test_ip_literals_are_connected_to_directly_and_names_resolved(
    host: str, family: socket.AddressFamily | None
) -> None:
    assert ip_literal_family(host) == family


async def test_a_named_worker_is_resolved_and_connected_to() -> None:
    with trio.fail_after(GUARD_S):
        async with pool_and_upstream() as (pool, upstream):
            url = upstream.url.replace("127.0.0.1", "localhost")
            for _ in range(2):
                async with pool.request(url, "GET", "/", [], b"") as response:
                    assert response.status == 200
                    assert await response.read() == b"ok"
            stats = pool.statistics()
            assert (stats.opened, stats.reused) == (1, 1)


async def test_an_ipv6_literal_worker_is_connected_to() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    listener = trio.socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        await listener.bind(("::1", 0))
    except OSError:
        listener.close()
        pytest.skip("no IPv6 loopback on this machine")
    with listener, trio.fail_after(GUARD_S):
        listener.listen()
        port = listener.getsockname()[1]
        pool = UpstreamPool()

        async def answer() -> None:
            peer, _ = await listener.accept()
            with peer:
                await peer.recv(65536)
                await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            async with pool.request(f"http://[::1]:{port}", "GET", "/", [], b"") as response:
                assert response.status == 200
                assert await response.read() == b"ok"
        assert pool.statistics().opened == 1
        await pool.aclose()


async def test_connect_timeout_leaves_a_slow_answer_alone() -> None:
    async def slow(exchange: Exchange) -> None:
        await trio.sleep(0.3)  # the worker's own slowness, longer than the connect timeout
        await ok(exchange)

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(slow) as (pool, upstream):
            for _ in range(2):
                async with pool.request(
                    upstream.url, "GET", "/", [], b"", connect_timeout_s=0.05
                ) as response:
                    assert response.status == 200
                    assert await response.read() == b"ok"
            stats = pool.statistics()
            assert (stats.opened, stats.reused) == (1, 1)


async def test_connect_timeout_is_exact_on_a_mock_clock(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never_connects(host: str, port: int) -> trio.SocketStream:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    monkeypatch.setattr(trio, "open_tcp_stream", never_connects)
    pool = UpstreamPool()
    with pytest.raises(UpstreamConnectTimeout):
        # A name, not an IP literal: it is resolved and connected by trio.open_tcp_stream.
        url = "http://worker.test:9"
        async with pool.request(url, "GET", "/", [], b"", connect_timeout_s=2.5):
            pytest.fail("no response expected")
    assert trio.current_time() == 2.5
    assert pool.statistics().opened == 0


async def test_https_and_malformed_urls_are_refused_before_any_connection() -> None:
    pool = UpstreamPool()
    for url, message in [
        ("https://127.0.0.1:1", "TLS to workers is not supported"),
        ("ftp://127.0.0.1:1", "must start with http://"),
        ("http://127.0.0.1:notaport", "malformed"),
    ]:
        with pytest.raises(InvalidWorkerUrl, match=message):
            async with pool.request(url, "GET", "/", [], b""):
                pytest.fail("no response expected")
    assert pool.statistics().opened == 0


async def test_reset_after_the_head_raises_with_response_started() -> None:
    client_has_head = trio.Event()

    async def reset_mid_body(exchange: Exchange) -> None:
        await exchange.start(200, [(b"content-length", b"100")])
        await exchange.send(b"partial")
        await client_has_head.wait()
        exchange.reset()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(reset_mid_body) as (pool, upstream):
            with pytest.raises(UpstreamProtocolError) as caught:
                async with pool.request(upstream.url, "GET", "/", [], b"") as response:
                    assert response.status == 200
                    assert await response.receive_some() == b"partial"
                    client_has_head.set()
                    await response.receive_some()
            assert caught.value.response_started is True
            assert "ConnectionResetError" in str(caught.value)

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total, stats.in_use) == (1, 1, 0, 0)


async def test_response_not_read_to_the_end_closes_the_connection() -> None:
    async def ten_bytes(exchange: Exchange) -> None:
        await exchange.respond(200, [(b"x-connection", b"%d" % exchange.connection_id)], b"x" * 10)

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(ten_bytes) as (pool, upstream):
            async with pool.request(upstream.url, "GET", "/", [], b"") as response:
                assert response.status == 200
            await upstream.wait_ended(1)
            assert pool.statistics().idle_total == 0
            assert await get(pool, upstream) == b"2"

            stats = pool.statistics()
            assert (stats.opened, stats.reused, stats.closed, stats.idle_total) == (2, 0, 1, 1)


async def test_cancellation_mid_body_closes_the_connection_and_keeps_the_pool_usable() -> None:
    async def first_chunk_then_hang(exchange: Exchange) -> None:
        if exchange.connection_id == 1:
            await exchange.start(200, [])
            await exchange.send(b"first")
            await trio.sleep_forever()
        await ok(exchange)

    received: list[bytes] = []

    async def read_all(pool: UpstreamPool, upstream: RawUpstream) -> None:
        async with pool.request(upstream.url, "GET", "/", [], b"") as response:
            while chunk := await response.receive_some():
                received.append(chunk)

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(first_chunk_then_hang) as (pool, upstream):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all, pool, upstream)
                await trio.testing.wait_all_tasks_blocked()
                assert received == [b"first"]
                assert pool.statistics().in_use == 1
                nursery.cancel_scope.cancel()

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total, stats.in_use) == (1, 1, 0, 0)
            assert await get(pool, upstream) == b"2"
            assert pool.statistics().opened == 2


async def test_chunks_arrive_separately_as_the_server_sends_them() -> None:
    first_seen = trio.Event()
    second_seen = trio.Event()

    async def stream_two_chunks(exchange: Exchange) -> None:
        await exchange.start(200, [])
        await exchange.send(b"one")
        await first_seen.wait()
        await exchange.send(b"two")
        await second_seen.wait()
        await exchange.end()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(stream_two_chunks) as (pool, upstream):
            async with pool.request(upstream.url, "GET", "/", [], b"") as response:
                assert (b"transfer-encoding", b"chunked") in response.headers
                assert await response.receive_some() == b"one"
                first_seen.set()
                assert await response.receive_some() == b"two"
                second_seen.set()
                assert await response.receive_some() == b""
                assert await response.receive_some() == b""

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total) == (1, 0, 1)


async def test_server_connection_close_is_not_pooled() -> None:
    async def close_after(exchange: Exchange) -> None:
        await exchange.respond(200, [(b"connection", b"close")], b"bye")

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(close_after) as (pool, upstream):
            async with pool.request(upstream.url, "GET", "/", [], b"") as response:
                assert await response.read() == b"bye"
            await upstream.wait_ended(1)

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total) == (1, 1, 0)


async def test_aclose_closes_idle_now_and_in_use_on_return() -> None:
    with trio.fail_after(GUARD_S):
        async with pool_and_upstream() as (pool, upstream):
            async with pool.request(upstream.url, "GET", "/", [], b"") as held:
                await get(pool, upstream)
                assert pool.statistics().idle_total == 1
                await pool.aclose()
                assert pool.statistics().closed == 1
                await held.read()
            await upstream.wait_ended(2)

            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.idle_total, stats.in_use) == (2, 2, 0, 0)


# -- the per-worker connection cap ------------------------------------------------------


async def test_checkouts_beyond_the_cap_wait_in_line_and_get_the_returned_connection() -> None:
    release = trio.Event()

    async def held_until_released(exchange: Exchange) -> None:
        if exchange.index == 0 and exchange.connection_id == 1:
            await release.wait()
        await ok(exchange)

    order: list[int] = []

    async def one(index: int) -> None:
        await get(pool, upstream)
        order.append(index)

    with trio.fail_after(GUARD_S):
        settings = PoolSettings(max_connections_per_worker=1)
        async with pool_and_upstream(held_until_released, settings) as (pool, upstream):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0)
                await wait_until(lambda: upstream.requests == 1)
                for index in (1, 2, 3):
                    nursery.start_soon(one, index)
                    await wait_until(lambda index=index: pool.statistics().waiting == index)
                release.set()
            stats = pool.statistics()
            # One socket carried all four, handed from each request to the next in line.
            assert (stats.opened, stats.reused, stats.waiting, upstream.accepted) == (1, 3, 0, 1)
            assert order == [0, 1, 2, 3]


async def test_a_wait_at_the_cap_ends_with_a_local_shortage_after_the_connect_timeout() -> None:
    async def never_answers(exchange: Exchange) -> None:
        await trio.sleep_forever()

    with trio.fail_after(GUARD_S):
        settings = PoolSettings(max_connections_per_worker=1)
        async with (
            pool_and_upstream(never_answers, settings) as (pool, upstream),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(get, pool, upstream)
            await wait_until(lambda: upstream.requests == 1)
            with pytest.raises(LocalShortage) as caught:
                async with pool.request(upstream.url, "GET", "/", [], b"", connect_timeout_s=0.2):
                    pytest.fail("no response expected")
            assert caught.value.kind == "pool_wait_timeout"
            stats = pool.statistics()
            assert (stats.opened, stats.waiting, stats.local_errors) == (
                1,
                0,
                {"pool_wait_timeout": 1},
            )
            assert upstream.accepted == 1
            nursery.cancel_scope.cancel()
        assert pool.statistics().in_use == 0


async def test_a_waiter_cancelled_in_line_leaves_no_slot_taken() -> None:
    release = trio.Event()

    async def held_until_released(exchange: Exchange) -> None:
        if exchange.connection_id == 1 and exchange.index == 0:
            await release.wait()
        await ok(exchange)

    with trio.fail_after(GUARD_S):
        settings = PoolSettings(max_connections_per_worker=1)
        async with pool_and_upstream(held_until_released, settings) as (pool, upstream):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(get, pool, upstream)
                await wait_until(lambda: upstream.requests == 1)
                with trio.move_on_after(0.1):
                    await get(pool, upstream)
                assert pool.statistics().waiting == 0
                release.set()
            # The slot came back: the next checkout reuses the connection at once.
            assert await get(pool, upstream) == b"1"
            assert pool.statistics().opened == 1


async def test_emfile_on_connect_is_a_local_shortage_not_a_connect_error() -> None:
    """The process out of file descriptors: the router's own trouble, not the worker's."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with socket.socket() as listener, trio.fail_after(GUARD_S):
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        pool = UpstreamPool()
        hoard: list[socket.socket] = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
            with contextlib.suppress(OSError):
                while True:
                    hoard.append(socket.socket())
            with pytest.raises(LocalShortage) as caught:
                async with pool.request(url, "GET", "/", [], b""):
                    pytest.fail("no response expected")
        finally:
            for sock in hoard:
                sock.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert caught.value.kind == "emfile"
        assert pool.statistics().local_errors == {"emfile": 1}
        assert pool.statistics().opened == 0


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodyless_answer_with_connection_close_is_not_pooled(status: int) -> None:
    """Found by the upstream fuzz: a 204/304 skipped the head's `connection: close`."""

    async def bodyless_then_hold(exchange: Exchange) -> None:
        await exchange.send_raw(b"HTTP/1.1 %d No Body\r\nconnection: close\r\n\r\n" % status)
        await exchange.hold_until_peer_closes()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(bodyless_then_hold) as (pool, upstream):
            async with pool.request(upstream.url, "GET", "/", [], b"") as response:
                assert response.status == status
                assert await response.read() == b""
            stats = pool.statistics()
            assert (stats.idle_total, stats.closed) == (0, 1)


async def test_a_head_dripped_byte_by_byte_is_read_whole() -> None:
    head = b"HTTP/1.1 200 OK\r\nx-pad: " + b"p" * 2000 + b"\r\ncontent-length: 2\r\n\r\n"

    async def drip(exchange: Exchange) -> None:
        for index in range(len(head)):
            await exchange.send_raw(head[index : index + 1])
            if index % 200 == 0:
                await trio.sleep(0.001)  # real time: separate reads on the router's side
        await exchange.send_raw(b"ok")

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(drip) as (pool, upstream):
            async with pool.request(upstream.url, "GET", "/", [], b"") as response:
                assert response.status == 200
                assert dict(response.headers)[b"x-pad"] == b"p" * 2000
                assert await response.read() == b"ok"


async def test_a_head_over_the_bound_in_many_reads_is_refused() -> None:
    async def endless_head(exchange: Exchange) -> None:
        await exchange.send_raw(b"HTTP/1.1 200 OK\r\n")
        for _ in range(80):
            await exchange.send_raw(b"x-pad: " + b"p" * 1000 + b"\r\n")
            await trio.sleep(0.001)  # real time: separate reads on the router's side
        await exchange.hold_until_peer_closes()

    with trio.fail_after(GUARD_S):
        async with pool_and_upstream(endless_head) as (pool, upstream):
            with pytest.raises(UpstreamProtocolError, match="head exceeds 65536 bytes"):
                async with pool.request(upstream.url, "GET", "/", [], b""):
                    pytest.fail("no response expected")
            assert pool.statistics().closed == 1


@pytest.mark.parametrize("pooled", [True, False])
async def test_a_head_not_there_by_its_deadline_times_out_and_closes_the_connection(
    pooled: bool,
) -> None:
    """The response head's deadline, on a pooled connection (the pool's timer closes it)
    and on a fresh one (a cancel scope around connect and exchange): UpstreamTimeout at
    the deadline, the connection closed, its slot free, the worker asked once."""
    answered = 0

    async def first_then_silence(exchange: Exchange) -> None:
        nonlocal answered
        if answered == 0 and pooled:
            answered += 1
            await ok(exchange)
            return
        await trio.sleep_forever()

    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(first_then_silence) as upstream,
            open_upstream_pool(PoolSettings(max_connections_per_worker=1)) as pool,
        ):
            if pooled:
                await get(pool, upstream)
            started = trio.current_time()
            with pytest.raises(UpstreamTimeout):
                async with pool.request(
                    upstream.url, "POST", "/", [], b"{}", head_deadline=started + 0.2
                ):
                    pytest.fail("no head came")
            waited = trio.current_time() - started
            assert 0.2 <= waited < 2.0, waited
            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.in_use, stats.idle_total) == (1, 1, 0, 0)
            assert pool.deadlines.pending <= 1
            # Its slot is free: the next request connects at once (the cap is 1).
            answered = 0
            pooled = True
            assert await get(pool, upstream) == b"2"


@pytest.mark.parametrize("timer", [True, False])
async def test_body_bytes_not_there_by_their_deadline_time_out_and_close_the_connection(
    timer: bool,
) -> None:
    """A stream's head came, then nothing: the read's deadline, kept by the pool's timer
    (a pool opened with its tasks) or by a cancel scope (a bare pool), ends it with
    UpstreamTimeout at the deadline and the connection is not reused."""

    async def head_then_silence(exchange: Exchange) -> None:
        await exchange.start(200, [(b"transfer-encoding", b"chunked")])
        await trio.sleep_forever()

    with trio.fail_after(GUARD_S):
        async with open_raw_upstream(head_then_silence) as upstream, AsyncExitStack() as stack:
            if timer:
                pool = await stack.enter_async_context(open_upstream_pool())
            else:
                pool = UpstreamPool()
            async with pool.request(upstream.url, "POST", "/", [], b"{}") as response:
                started = trio.current_time()
                with pytest.raises(UpstreamTimeout):
                    await response.receive_some(started + 0.2)
                waited = trio.current_time() - started
            assert 0.2 <= waited < 2.0, waited
            stats = pool.statistics()
            assert (stats.opened, stats.closed, stats.in_use, stats.idle_total) == (1, 1, 0, 0)

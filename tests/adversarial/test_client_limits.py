"""Greedy clients at the client edge: the global budget of buffered request bodies, the
head and body size limits, a flood of connections past the cap, and pipelining. After
each: no 500, no lease left, the router still serving."""

from __future__ import annotations

import socket
from functools import partial

import orjson
import trio

from router.fake_worker.settings import FakeWorkerSettings
from router.http.server.load import ServerLoad
from router.http.server.loop import serve_http
from router.http.server.messages import Request, ResponseWriter
from tests.adversarial.support import (
    CHAT,
    FOLLOW_UP,
    Setup,
    assert_still_serving,
    exchange,
    metric,
    open_setup,
    statuses,
)
from tests.support.waiting import wait_until

GUARD_S = 30.0
BUDGET = "router_buffered_body_bytes"
_HEAD = FOLLOW_UP[: FOLLOW_UP.index(b"Content-Length")]


def _post(body: bytes, *, chunked: bool = False, close: bool = False) -> bytes:
    head = _HEAD + b"Connection: close\r\n" if close else _HEAD
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def _large_body(size: int) -> bytes:
    body = orjson.dumps({**CHAT, "pad": ""})
    return orjson.dumps({**CHAT, "pad": "a" * (size - len(body))})


async def test_a_body_past_the_global_budget_is_503_and_the_budget_comes_back() -> None:
    first_body, second_body = _large_body(6000), _large_body(6000)
    slow = FakeWorkerSettings(ttft_ms=1500)
    with trio.fail_after(GUARD_S):
        async with open_setup(slow, max_buffered_body_bytes=10_000) as setup:
            async with trio.open_nursery() as nursery:
                answers: list[bytes] = []

                async def first() -> None:
                    answers.append(await exchange(setup.port, _post(first_body, close=True)))

                nursery.start_soon(first)
                # The first request is with the worker: its body is held until it is done.
                await wait_until(lambda: setup.dispatches == 1)
                assert await metric(setup.router, BUDGET) == len(first_body)
                second = await exchange(setup.port, _post(second_body))
                assert statuses(second) == [503]
                assert b"retry-after: 1\r\n" in second.lower()
                assert b'"server_busy"' in second
                assert setup.dispatches == 1
            assert statuses(answers[0]) == [200]
            assert await metric(setup.router, BUDGET) == 0
            await assert_still_serving(setup)


async def test_a_declared_length_alone_takes_nothing_from_the_budget() -> None:
    """Heads that declare large bodies and send none cannot starve everyone else."""
    head = _HEAD + b"Content-Length: 4000\r\n\r\n"
    with trio.fail_after(GUARD_S):
        async with open_setup(max_buffered_body_bytes=10_000) as setup:
            streams = [await trio.open_tcp_stream("127.0.0.1", setup.port) for _ in range(5)]
            try:
                for count, stream in enumerate(streams, start=1):
                    # One byte of each body: held once its head was read, and only it.
                    await stream.send_all(head + b"{")
                    await wait_until(partial(_holds, setup, count))
                await assert_still_serving(setup)
                assert _held(setup) == len(streams)
            finally:
                for stream in streams:
                    await stream.aclose()


async def test_a_chunked_body_past_the_budget_is_503_when_it_crosses_it() -> None:
    with trio.fail_after(GUARD_S):
        async with open_setup(max_buffered_body_bytes=4096) as setup:
            answer = await exchange(setup.port, _post(_large_body(6000), chunked=True))
            assert statuses(answer) == [503]
            assert setup.dispatches == 0
            assert await metric(setup.router, BUDGET) == 0
            await assert_still_serving(setup)


async def test_budget_bytes_are_given_back_when_the_client_leaves_mid_body() -> None:
    body = _large_body(6000)
    with trio.fail_after(GUARD_S):
        async with open_setup() as setup:
            for data in (_post(body), _post(body, chunked=True)):
                stream = await trio.open_tcp_stream("127.0.0.1", setup.port)
                async with stream:
                    # Everything but the body's last 1000 bytes (and the chunked ending).
                    await stream.send_all(data[:-1000])
                    # The budget is taken as the body's bytes come.
                    await wait_until(lambda: _held(setup) > 4000)
                await wait_until(lambda: _held(setup) == 0)
            assert setup.dispatches == 0
            await assert_still_serving(setup)


def _holds(setup: Setup, count: int) -> bool:
    return _held(setup) == count


def _held(setup: Setup) -> float:
    value = setup.router.metrics.registry.get_sample_value(BUDGET)
    assert value is not None, f"{BUDGET} is not registered"
    return value


async def test_a_head_over_the_limit_is_431_and_a_body_over_it_413() -> None:
    oversized_head = _HEAD + b"X-Pad: " + b"a" * 70_000 + b"\r\nContent-Length: 2\r\n\r\n{}"
    with trio.fail_after(GUARD_S):
        async with open_setup(max_body_bytes=1024) as setup:
            for data, status in (
                (oversized_head, 431),
                (_post(_large_body(2000)), 413),
                (_post(_large_body(2000), chunked=True), 413),
                (
                    _HEAD
                    + b"Transfer-Encoding: chunked\r\n\r\n"
                    + b"200\r\n"
                    + b"a" * 512
                    + b"\r\n" * 1
                    + b"201\r\n"
                    + b"a" * 513
                    + b"\r\n0\r\n\r\n",
                    413,
                ),
            ):
                answer = await exchange(setup.port, data + FOLLOW_UP)
                assert statuses(answer) == [status], answer[:200]
            assert setup.dispatches == 0
            await assert_still_serving(setup)


async def test_pipelined_requests_are_served_in_order_until_a_bad_one() -> None:
    bad = _HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    with trio.fail_after(GUARD_S):
        async with open_setup() as setup:
            three = FOLLOW_UP * 2 + FOLLOW_UP.replace(
                b"Host: router", b"Host: router\r\nConnection: close"
            )
            answer = await exchange(setup.port, three)
            assert statuses(answer) == [200, 200, 200]
            assert setup.dispatches == 3
            answer = await exchange(setup.port, FOLLOW_UP + bad + FOLLOW_UP)
            assert statuses(answer) == [200, 400]
            assert setup.dispatches == 4
            await assert_still_serving(setup)


async def test_a_flood_past_the_connection_cap_is_turned_away_with_bounded_work() -> None:
    """Two connections fill the cap; 400 more arrive at once and never read or close. At
    most 64 of them are answered at a time (a task each); the rest are closed unanswered.
    Afterwards the task count is back to its baseline and the router serves."""
    flood = 400
    with trio.fail_after(GUARD_S):
        async with open_setup(max_connections=2, header_timeout_s=20.0) as setup:
            baseline = trio.lowlevel.current_statistics().tasks_living
            holders = [await trio.open_tcp_stream("127.0.0.1", setup.port) for _ in range(2)]
            peak = 0
            clients: list[socket.socket] = []
            try:
                for _ in range(flood):
                    client = socket.create_connection(("127.0.0.1", setup.port))
                    clients.append(client)
                # Watch the server accept and answer them all.
                with trio.move_on_after(2.0):
                    while True:
                        peak = max(peak, trio.lowlevel.current_statistics().tasks_living)
                        await trio.sleep(0.002)  # a sampling interval for the task peak, not a wait
                answered = 0
                for client in clients:
                    client.settimeout(5)
                    try:
                        data = client.recv(65536)
                    except (ConnectionResetError, TimeoutError):
                        data = b""
                    if data.startswith(b"HTTP/1.1 503 "):
                        answered += 1
            finally:
                for client in clients:
                    client.close()
                for holder in holders:
                    await holder.aclose()
            # Connection tasks (2 holders with their reader tasks) plus at most 64 answers.
            assert peak - baseline <= 2 * 2 + 64
            assert 0 < answered <= flood
            await wait_until(lambda: trio.lowlevel.current_statistics().tasks_living <= baseline)
            await assert_still_serving(setup)


async def test_budget_bytes_are_given_back_when_a_handler_raises_or_the_server_is_cancelled() -> (
    None
):
    """The two paths a router cannot show from outside: a handler that raises (a clean 500)
    and the server cancelled while a body is half read."""
    load = ServerLoad(body_limit=1 << 20)
    body = b"x" * 3000

    async def failing(request: Request, writer: ResponseWriter) -> None:
        assert load.body_bytes == len(body)
        raise RuntimeError("a handler bug")

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, failing, load=load))
            answer = await exchange(port, _post(body, close=True))
            assert statuses(answer) == [500]
            assert load.body_bytes == 0
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(_post(body)[:-1000])
                await wait_until(lambda: load.body_bytes == len(body) - 1000)
                nursery.cancel_scope.cancel()
    assert load.body_bytes == 0
    assert load.connections == 0


async def test_a_refused_head_request_is_answered_without_a_body() -> None:
    """A HEAD request refused before its handler (here: a declared body over the limit,
    a chunked body that never ends, unframeable headers) gets its status line and headers, no body, and the
    connection closes; the server logs no failed connection."""
    oversized = b"HEAD /v1/models HTTP/1.1\r\nHost: router\r\nContent-Length: 5000\r\n\r\n"
    unfinished = b"HEAD /v1/models HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n"
    smuggling = unfinished.replace(b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n")
    with trio.fail_after(GUARD_S):
        async with open_setup(max_body_bytes=1024, body_timeout_s=0.5) as setup:
            for data, status in ((oversized, 413), (unfinished, 408), (smuggling, 400)):
                answer = await exchange(setup.port, data)
                assert answer.startswith(b"HTTP/1.1 %d " % status), answer
                assert answer.endswith(b"\r\n\r\n"), answer
            await assert_still_serving(setup)

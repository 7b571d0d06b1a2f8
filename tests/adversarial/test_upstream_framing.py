"""Workers that answer in broken HTTP, through a real router.

Each misbehaviour before the answer's first byte reached the client is a worker fault:
the request fails over to the healthy worker (the client gets 200), the bad worker's
dispatch shows once in `router_retries_total`, and its connection is never pooled. After
each: no 500, in-flight 0 everywhere, and the router still serves.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from tests.adversarial.upstream_stubs import GOOD_JSON, Edge, chat, open_edge
from tests.support.raw_upstream import Exchange
from tests.support.waiting import wait_until

GUARD_S = 30
REQUESTS = 4


def raw_answer(data: bytes, *, then_close: bool = True) -> Callable[[Exchange], object]:
    async def respond(exchange: Exchange) -> None:
        await exchange.send_raw(data)
        if then_close:
            exchange.close()
        else:
            await exchange.hold_until_peer_closes()

    return respond


def head(status_line: bytes, *headers: bytes) -> bytes:
    return status_line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


JSON_CL = b"content-length: %d" % len(GOOD_JSON)
JSON_CHUNK = b"%x\r\n" % len(GOOD_JSON) + GOOD_JSON  # its size line and data, no CRLF
CASES: dict[str, bytes] = {
    "garbage status line": b"\x00\xffnot http at all\r\n\r\n",
    "status 000": head(b"HTTP/1.1 000 Zero", b"content-length: 0"),
    "status 099": head(b"HTTP/1.1 099 Low", b"content-length: 0"),
    "status 600": head(b"HTTP/1.1 600 High", b"content-length: 0"),
    "status 999": head(b"HTTP/1.1 999 Nope", JSON_CL) + GOOD_JSON,
    "HTTP/2.0 status line": head(b"HTTP/2.0 200 OK", JSON_CL) + GOOD_JSON,
    "bare CR in the status line": head(b"HTTP/1.1 200 OK\rHTTP/1.1 200 OK", JSON_CL) + GOOD_JSON,
    "control byte in the reason": head(b"HTTP/1.1 200 O\x00K", JSON_CL) + GOOD_JSON,
    "1xx storm": head(b"HTTP/1.1 100 Continue") * 50
    + head(b"HTTP/1.1 200 OK", JSON_CL)
    + GOOD_JSON,
    "101 unasked": head(b"HTTP/1.1 101 Switching Protocols", b"upgrade: h2c"),
    "content-length shorter than the body": head(b"HTTP/1.1 200 OK", b"content-length: 5")
    + GOOD_JSON,
    "conflicting content-lengths": head(b"HTTP/1.1 200 OK", JSON_CL, b"content-length: 3")
    + GOOD_JSON,
    "bad content-length": head(b"HTTP/1.1 200 OK", b"content-length: -1") + GOOD_JSON,
    "transfer-encoding twice": head(
        b"HTTP/1.1 200 OK", b"transfer-encoding: chunked", b"transfer-encoding: chunked"
    )
    + JSON_CHUNK
    + b"\r\n0\r\n\r\n",
    "content-length and transfer-encoding": head(
        b"HTTP/1.1 200 OK", JSON_CL, b"transfer-encoding: chunked"
    )
    + JSON_CHUNK
    + b"\r\n0\r\n\r\n",
    "transfer-encoding gzip": head(b"HTTP/1.1 200 OK", b"transfer-encoding: gzip") + GOOD_JSON,
    "bad chunk size": head(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked")
    + b"zz\r\n"
    + GOOD_JSON,
    "chunk size beyond 64 bits": head(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked")
    + b"1" * 40
    + b"\r\n"
    + GOOD_JSON,
    "chunk data without CRLF": head(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked")
    + JSON_CHUNK
    + b"XX0\r\n\r\n",
    "header section too large": head(b"HTTP/1.1 200 OK", b"x-junk: " + b"a" * 70_000, JSON_CL)
    + GOOD_JSON,
    "malformed header line": head(b"HTTP/1.1 200 OK", b"no colon here", JSON_CL) + GOOD_JSON,
    "obs-fold header": head(b"HTTP/1.1 200 OK", JSON_CL, b"x-a: b", b" folded") + GOOD_JSON,
    "control byte in a relayed header": head(
        b"HTTP/1.1 200 OK", b"content-type:\x0bapplication/json", JSON_CL
    )
    + GOOD_JSON,
    "control byte in a header": head(b"HTTP/1.1 200 OK", b"x-a: b\x1fc", JSON_CL) + GOOD_JSON,
}
# Answers that break off: the worker closes where the framing says more is coming.
BREAKS: dict[str, bytes] = {
    "close mid-head": b"HTTP/1.1 200 OK\r\ncontent-le",
    "content-length longer than the body": head(b"HTTP/1.1 200 OK", b"content-length: 5000")
    + GOOD_JSON,
    "close mid-chunk": head(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked")
    + b"400\r\n"
    + GOOD_JSON,
    "close before the last chunk": head(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked")
    + JSON_CHUNK
    + b"\r\n",
}


async def assert_failed_over_every_time(edge: Edge, *, stream: bool = False) -> None:
    for _ in range(REQUESTS):
        response = await edge.client.post("/v1/chat/completions", json=chat(stream=stream))
        assert response.status_code == 200, response.text
        assert response.headers["x-router-worker"] == edge.good.url
    # Each client request reached the bad worker at most once, and each time that counts
    # as a retry; the good worker answered every request exactly once.
    assert 1 <= edge.bad_dispatches.count <= REQUESTS
    assert edge.good_dispatches.count == REQUESTS
    assert sum((await edge.counter("router_retries_total")).values()) == edge.bad_dispatches.count
    await edge.assert_no_harm_left()


# For a stream, a content-length shorter than the bytes is a complete (short) answer:
# see the test after this one.
FRAMING_PARAMS = [
    pytest.param(data, stream, id=f"{'stream' if stream else 'unary'}-{name}")
    for name, data in CASES.items()
    for stream in (False, True)
    if not (stream and name == "content-length shorter than the body")
]


@pytest.mark.parametrize(("data", "stream"), FRAMING_PARAMS)
async def test_a_framing_error_fails_over_and_the_connection_is_not_pooled(
    data: bytes, stream: bool
) -> None:
    with trio.fail_after(GUARD_S):
        # The bad worker keeps each connection open after its answer: only the router's
        # refusal to pool it closes it.
        async with open_edge(raw_answer(data, then_close=False)) as edge:
            await assert_failed_over_every_time(edge, stream=stream)


async def test_a_stream_shorter_than_its_bytes_is_relayed_as_framed_and_not_pooled() -> None:
    """A 200 stream whose content-length ends before the bytes do: the router can only
    relay what the framing says (here: 5 bytes), and must not reuse the connection whose
    surplus bytes would be read as the next answer."""
    with trio.fail_after(GUARD_S):
        async with open_edge(
            raw_answer(CASES["content-length shorter than the body"], then_close=False),
            max_attempts=1,
        ) as edge:
            for _ in range(2):  # round robin: one to each worker of the model
                response = await edge.client.post("/v1/chat/completions", json=chat(stream=True))
                assert response.status_code == 200
                if response.headers["x-router-worker"] == edge.bad.url:
                    assert response.content == GOOD_JSON[:5]
            assert edge.bad_dispatches.count == 1
            await edge.assert_no_harm_left()


@pytest.mark.parametrize("data", BREAKS.values(), ids=BREAKS.keys())
async def test_an_answer_broken_off_fails_over(data: bytes) -> None:
    with trio.fail_after(GUARD_S):
        async with open_edge(raw_answer(data)) as edge:
            await assert_failed_over_every_time(edge)


async def test_a_few_interim_responses_are_skipped() -> None:
    answer = (
        head(b"HTTP/1.1 100 Continue")
        + head(b"HTTP/1.1 103 Early Hints", b"link: </a>")
        + head(b"HTTP/1.1 200 OK", JSON_CL)
        + GOOD_JSON
    )
    with trio.fail_after(GUARD_S):
        async with open_edge(raw_answer(answer), max_attempts=1) as edge:
            for _ in range(2):
                response = await edge.client.post("/v1/chat/completions", json=chat())
                assert response.status_code == 200
            assert edge.bad_dispatches.count == 1
            assert await edge.counter("router_retries_total") == {}
            await edge.assert_no_harm_left(bad_answers_were_valid=True)


async def test_a_worker_that_reads_the_request_and_closes_is_dispatched_once_per_attempt() -> None:
    """Hole 4: the worker reads the whole request, works 200 ms and closes without a word.

    Every time it got a request, that shows as an attempt (a retry on the good worker, a
    fault on its breaker), never as a silent resend: its request count equals the
    retries counted.
    """

    answered: list[Exchange] = []

    async def read_then_vanish(exchange: Exchange) -> None:
        if not answered:
            answered.append(exchange)
            await exchange.respond(200, [], GOOD_JSON)  # leaves a pooled connection behind
            return
        await trio.sleep(0.2)
        exchange.close()

    with trio.fail_after(GUARD_S):
        async with open_edge(read_then_vanish, breaker_failure_threshold=1000) as edge:
            for _ in range(2 * REQUESTS):
                response = await edge.client.post("/v1/chat/completions", json=chat())
                assert response.status_code == 200
            bad_answers = len(answered)
            retried = await edge.counter("router_retries_total")
            assert edge.bad_dispatches.count - bad_answers == sum(retried.values()) >= 1
            assert set(retried) == {"transport_error"}
            # ... and each counted against the worker's breaker, once.
            breaker = (await edge.workers())[edge.bad.url]["breaker"]
            assert breaker["consecutive_faults"] == sum(retried.values())
            await edge.assert_no_harm_left()


async def test_a_connection_the_worker_closed_while_idle_is_replaced_without_a_second_send() -> (
    None
):
    """The stale case of hole 4: found at checkout, before the request is written."""

    async def answer_then_close(exchange: Exchange) -> None:
        await exchange.respond(200, [(b"content-type", b"application/json")], GOOD_JSON)
        exchange.close()

    with trio.fail_after(GUARD_S):
        async with open_edge(answer_then_close, max_attempts=1) as edge:
            served_by_bad = 0
            for _ in range(REQUESTS):
                response = await edge.client.post("/v1/chat/completions", json=chat())
                assert response.status_code == 200
                if response.headers["x-router-worker"] == edge.bad.url:
                    served_by_bad += 1
                    # The worker's close has reached the router's idle connection.
                    await wait_until(lambda: edge.bad.ended >= edge.bad_dispatches.count)
            assert served_by_bad >= 2
            assert edge.bad_dispatches.count == served_by_bad  # each request reached it once
            assert await edge.counter("router_retries_total") == {}
            stale = await edge.counter("router_upstream_stale_discarded_total")
            assert stale == {"": served_by_bad - 1}
            await edge.assert_no_harm_left(bad_answers_were_valid=True)


async def test_a_broken_worker_trips_only_its_own_breaker() -> None:
    with trio.fail_after(GUARD_S):
        async with open_edge(
            raw_answer(CASES["status 000"]),
            breaker_failure_threshold=1,
            breaker_cooldown_s=60,
            breaker_max_cooldown_s=60,
        ) as edge:
            for _ in range(REQUESTS):
                assert (
                    await edge.client.post("/v1/chat/completions", json=chat())
                ).status_code == 200
            workers = await edge.workers()
            assert workers[edge.bad.url]["breaker"]["state"] == "open"
            assert workers[edge.good.url]["breaker"]["state"] == "closed"
            assert edge.bad_dispatches.count == 1  # open after its one fault: no more dispatches

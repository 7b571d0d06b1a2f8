"""SSE from a worker, through a real router: events go out as they complete, whatever their
line ends, and a stream that breaks keeps its complete events before the error event."""

from __future__ import annotations

import orjson
import pytest
import trio

from tests.adversarial.upstream_stubs import Edge, chat, open_edge
from tests.support.http_client import RawClient
from tests.support.raw_upstream import Exchange

GUARD_S = 30
EVENTS = 5
GAP_S = 0.3
# Functional, not a latency figure: an event held until the next one arrives would be
# GAP_S late; one relayed at once arrives within a few milliseconds on loopback (0.3 to
# 2.8 ms measured on a busy machine), so 100 ms separates the two with room to spare.
LATE_S = 0.1


def event(index: int, end: bytes) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"%d"}}]}' % index + end + end


async def read_stream_with_arrival_times(
    edge: Edge, expected: list[bytes]
) -> tuple[bytes, list[float]]:
    """The stream's body and, for each expected event, when it had fully arrived."""
    client = await RawClient.connect(edge.router.port)
    try:
        body = orjson.dumps(chat(stream=True))
        await client.send_request(
            "POST", "/v1/chat/completions", [("content-type", "application/json")], body
        )
        head = await client.read_head("POST")
        assert head.status == 200
        received = b""
        arrivals: list[float] = []
        while (chunk := await client.read_chunk()) is not None:
            received += chunk
            now = trio.current_time()
            while (
                len(arrivals) < len(expected)
                and b"".join(expected[: len(arrivals) + 1]) in received
            ):
                arrivals.append(now)
        return received, arrivals
    finally:
        await client.aclose()


async def stream_from_the_bad_worker(edge: Edge) -> bytes:
    """Two streams (round robin: one per worker), each answered 200; the body the bad
    worker's stream reached the client with."""
    bodies = {}
    for _ in range(2):
        response = await edge.client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200
        bodies[response.headers["x-router-worker"]] = response.content
    return bodies[edge.bad.url]


@pytest.mark.parametrize("end", [b"\r\n", b"\n", b"\r"], ids=["crlf", "lf", "cr"])
async def test_each_event_reaches_the_client_as_soon_as_it_is_sent(end: bytes) -> None:
    sent_at: list[float] = []

    async def paced_events(exchange: Exchange) -> None:
        await exchange.start(200, [(b"content-type", b"text/event-stream")])
        for index in range(EVENTS):
            if index:
                await trio.sleep(GAP_S)  # real time: the pacing under test
            sent_at.append(trio.current_time())
            await exchange.send(event(index, end))
        await exchange.end()

    expected = [event(index, end) for index in range(EVENTS)]
    with trio.fail_after(GUARD_S):
        async with open_edge(paced_events, max_attempts=1) as edge:
            # Round robin: the bad (here: paced) worker takes one of two requests.
            body, arrivals = await read_stream_with_arrival_times(edge, expected)
            if not sent_at:
                body, arrivals = await read_stream_with_arrival_times(edge, expected)
            assert body == b"".join(expected)
            delays = [arrived - sent for arrived, sent in zip(arrivals, sent_at, strict=True)]
            print(f"\nevent delays (s): {[round(d, 4) for d in delays]}")
            assert max(delays) < LATE_S, delays
            await edge.assert_no_harm_left(bad_answers_were_valid=True)


async def test_a_stream_broken_mid_event_keeps_its_complete_events_before_the_error() -> None:
    complete = [event(0, b"\r\n"), event(1, b"\r\n")]

    async def break_mid_event(exchange: Exchange) -> None:
        await exchange.start(200, [(b"content-type", b"text/event-stream")])
        await exchange.send(b"".join(complete) + b'data: {"choices":[{"del')
        exchange.close()

    with trio.fail_after(GUARD_S):
        async with open_edge(break_mid_event, max_attempts=1) as edge:
            broken = await stream_from_the_bad_worker(edge)
            assert broken.startswith(b"".join(complete) + b"event: error\ndata: ")
            assert b'"code":"stream_interrupted"' in broken
            assert broken.endswith(b"\n\n")
            assert edge.bad_dispatches.count == 1
            assert await edge.counter("router_retries_total") == {}
            await edge.assert_no_harm_left()


async def test_an_event_larger_than_the_bound_goes_out_and_the_error_event_stays_whole() -> None:
    big = b"data: " + b"x" * (100 * 1024)  # no end: past 64 KiB it goes out regardless

    async def one_huge_unfinished_event(exchange: Exchange) -> None:
        await exchange.start(200, [(b"content-type", b"text/event-stream")])
        await exchange.send(big)
        exchange.close()

    with trio.fail_after(GUARD_S):
        async with open_edge(one_huge_unfinished_event, max_attempts=1) as edge:
            broken = await stream_from_the_bad_worker(edge)
            assert broken.startswith(big[: 64 * 1024])
            # A blank line closes the partial event, so the error event parses on its own.
            assert b"\n\nevent: error\ndata: " in broken
            await edge.assert_no_harm_left()


MID_STREAM_BREAKS = {
    "bad chunk size": b"zz\r\n",
    "chunk data without CRLF": b"5\r\nhelloXX",
    "close mid-chunk": b"400\r\ndata: {",
    # Refused by llhttp, which decodes the chunked body.
    "malformed chunk extension": b'5;a="q\r\nhello\r\n',
    "content-length in the trailer": b"0\r\ncontent-length: 5\r\n\r\n",
}


@pytest.mark.parametrize("tail", MID_STREAM_BREAKS.values(), ids=MID_STREAM_BREAKS.keys())
async def test_a_framing_error_mid_stream_ends_with_an_error_event_after_the_whole_events(
    tail: bytes,
) -> None:
    first = event(0, b"\n")

    async def first_event_then_broken_framing(exchange: Exchange) -> None:
        await exchange.send_raw(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(first)
            + first
            + b"\r\n"
        )
        await trio.sleep(0.05)  # real time: the first event goes out on its own
        await exchange.send_raw(tail)
        exchange.close()

    with trio.fail_after(GUARD_S):
        async with open_edge(first_event_then_broken_framing, max_attempts=1) as edge:
            broken = await stream_from_the_bad_worker(edge)
            assert broken.startswith(first + b"event: error\ndata: ")
            assert b'"code":"stream_interrupted"' in broken and broken.endswith(b"\n\n")
            assert edge.bad_dispatches.count == 1
            assert await edge.counter("router_retries_total") == {}
            await edge.assert_no_harm_left()

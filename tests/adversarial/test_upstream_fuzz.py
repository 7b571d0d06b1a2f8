"""Fuzz the worker edge: hostile response bytes from a stub worker, through a real router.

One router (in-process, real loopback sockets) runs for the whole test in a thread of its
own, in front of a stub worker that answers each request with the example's bytes, a
healthy worker of the same model (so a failure before the first byte has somewhere to
fail over to) and one of another model. Each example sends one request from the test
thread into that router's trio loop (`trio.from_thread.run`).

Properties, for every example:
- the client never gets a 5xx or a 429 (a pre-first-byte failure fails over to the good
  worker): only the good worker's 200 or a status the stub itself sent;
- a stream answered by the stub either carries its events or ends with an `error` event;
- no lease is left (in-flight 0 everywhere);
- a connection is left in the pool only after an answer h11 (the reference parser) reads
  as one complete, kept-alive response with nothing after it: never after a framing error.

`ROUTER_FUZZ_EXAMPLES` sets the number of examples (default 200; `make fuzz` runs more).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import h11
import httpx
import orjson
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.adversarial.upstream_stubs import GOOD_EVENTS, GOOD_JSON, Edge, chat, open_edge
from tests.support.raw_upstream import Exchange

EXAMPLES = int(os.environ.get("ROUTER_FUZZ_EXAMPLES", "200"))
STEP_GUARD_S = 20


def reference_verdict(data: bytes) -> bool:
    """Whether h11, as a client after a POST, reads `data` as exactly one complete final
    response on a connection that stays open: the only case a pool may keep it."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(
        h11.Request(method="POST", target="/", headers=[("host", "w"), ("content-length", "0")])
    )
    connection.send(h11.EndOfMessage())
    connection.receive_data(data)
    try:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.EndOfMessage):
                break
    except h11.RemoteProtocolError:
        return False
    return connection.their_state is h11.DONE and connection.trailing_data[0] == b""


class Rig:
    """The router and its stub workers, running in a trio loop of their own thread."""

    def __init__(self) -> None:
        self.answer = b""
        self.hold = False
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._open: list[Exchange] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Rig:
        self._thread.start()
        self._ready.wait(30)
        if self._failure is not None:
            raise self._failure
        assert self._ready.is_set(), "the router did not start"
        return self

    def __exit__(self, *exc_info: object) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(30)

    def run(self, scenario: Any, *args: Any) -> Any:
        return trio.from_thread.run(scenario, *args, trio_token=self.token)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the test thread
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with open_edge(
            self._respond, first_byte_timeout_s=2.0, stream_idle_timeout_s=1.0
        ) as edge:
            self.edge: Edge = edge
            self.token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    async def _respond(self, exchange: Exchange) -> None:
        await exchange.send_raw(self.answer)
        if self.hold:
            self._open.append(exchange)
            await exchange.hold_until_peer_closes()
        else:
            exchange.close()

    def close_held(self) -> None:
        """Closes the stub's side of connections held open by earlier examples."""
        while self._open:
            self._open.pop().close()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with Rig() as running:
        yield running


# -- what the stub answers --------------------------------------------------------------

STATUSES = st.sampled_from([200, 200, 200, 201, 204, 304, 400, 404, 429, 500, 503])
TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A body and its content type: JSON, an SSE stream (any line ends), or bytes."""
    kind = draw(st.sampled_from(["json", "sse", "bytes"]))
    if kind == "json":
        return GOOD_JSON, b"application/json"
    if kind == "sse":
        end = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
        events = draw(st.lists(st.sampled_from(GOOD_EVENTS[:-1]), max_size=4))
        stream = b"".join(e.rstrip(b"\n") + end + end for e in [*events, GOOD_EVENTS[-1]])
        return stream, b"text/event-stream"
    return draw(st.binary(max_size=200)), b"application/octet-stream"


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out = []
    position = 0
    for size in sizes:
        piece = body[position : position + size]
        if not piece:
            break
        out.append(b"%x\r\n" % len(piece) + piece + b"\r\n")
        position += len(piece)
    if position < len(body):
        rest = body[position:]
        out.append(b"%x\r\n" % len(rest) + rest + b"\r\n")
    return b"".join(out) + b"0\r\n\r\n"


@st.composite
def valid_answers(draw: st.DrawFn) -> bytes:
    status = draw(STATUSES)
    body, content_type = draw(bodies())
    headers = [b"content-type: " + content_type]
    headers += [
        name.encode() + b": " + value.encode()
        for name, value in draw(st.lists(st.tuples(TOKEN, TOKEN), max_size=3))
    ]
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if framing == "length":
        headers.append(b"content-length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        headers.append(b"transfer-encoding: chunked")
        payload = chunked(body, draw(st.lists(st.integers(1, 64), max_size=6)))
    else:
        headers.append(b"connection: close")
        payload = body
    interim = draw(
        st.sampled_from(
            [
                b"",
                b"HTTP/1.1 100 Continue\r\n\r\n",
                b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n",
            ]
        )
    )
    return (
        interim
        + b"HTTP/1.1 %d OK\r\n" % status
        + b"".join(h + b"\r\n" for h in headers)
        + b"\r\n"
        + payload
    )


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid answer with a few byte-level mutations: flips, cuts, insertions, repeats."""
    data = bytearray(draw(valid_answers()))
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        position = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "cut", "insert", "repeat", "truncate"]))
        if action == "flip":
            data[position] = draw(st.integers(0, 255))
        elif action == "cut":
            del data[position : position + draw(st.integers(1, 16))]
        elif action == "insert":
            data[position:position] = draw(
                st.sampled_from(
                    [b"\r\n", b"\n", b"\r", b" ", b":", b"\x00", b"0", b"f", b"\r\n\r\n"]
                )
            )
        elif action == "repeat":
            data[position:position] = data[position : position + draw(st.integers(1, 32))]
        else:
            del data[position:]
    return bytes(data)


@st.composite
def random_heads(draw: st.DrawFn) -> bytes:
    """Random status lines and header sections, then a small body."""
    version = draw(
        st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"http/1.1", b""])
    )
    status = draw(st.one_of(st.integers(0, 999).map(lambda n: b"%03d" % n), st.binary(max_size=5)))
    reason = draw(st.binary(max_size=10))
    headers = draw(st.lists(st.binary(max_size=40), max_size=5))
    return (
        version
        + b" "
        + status
        + b" "
        + reason
        + b"\r\n"
        + b"\r\n".join(headers)
        + b"\r\n\r\n"
        + GOOD_JSON
    )


@st.composite
def bad_chunking(draw: st.DrawFn) -> bytes:
    """Chunked bodies with hostile size lines, extensions and terminators."""
    lines = draw(
        st.lists(
            st.one_of(
                st.sampled_from(
                    [
                        b"5",
                        b"-1",
                        b"0x5",
                        b"ffffffffffffffffff",
                        b"5;ext=1",
                        b"5 ",
                        b" 5",
                        b"",
                        b"g",
                    ]
                ),
                st.binary(max_size=12),
            ),
            min_size=1,
            max_size=4,
        )
    )
    pieces = [
        line + b"\r\n" + draw(st.binary(max_size=8)) + draw(st.sampled_from([b"\r\n", b"", b"\n"]))
        for line in lines
    ]
    ending = draw(
        st.sampled_from(
            [b"0\r\n\r\n", b"0\r\n", b"", b"0\r\nx: y\r\n\r\n", b"0\r\nbad trailer\r\n\r\n"]
        )
    )
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"".join(pieces) + ending


@st.composite
def bytes_after(draw: st.DrawFn) -> bytes:
    """A valid answer and bytes past its end: line ends (which llhttp skips between
    messages without a word), another response, garbage."""
    extra = draw(
        st.one_of(
            st.sampled_from(
                [b"\r\n", b"\n", b"\r", b"\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n"]
            ),
            st.binary(min_size=1, max_size=8),
        )
    )
    return draw(valid_answers()) + extra


answers = st.one_of(valid_answers(), mutated(), random_heads(), bad_chunking(), bytes_after())


# -- the property -----------------------------------------------------------------------


async def one_request(rig: Rig, stream: bool) -> tuple[int, bytes, str | None, int, int]:
    edge = rig.edge
    # Each example starts with an empty pool, so what is pooled after it came from it.
    edge.router.app.generation.pool.sweep(trio.current_time() + 3600)
    with trio.fail_after(STEP_GUARD_S):
        response = await edge.client.post("/v1/chat/completions", json=chat(stream=stream))
        inflight = sum(worker.inflight for worker in edge.router.fleet.workers())
        pooled = edge.pooled_to_bad()
        return (
            response.status_code,
            response.content,
            response.headers.get("x-router-worker"),
            inflight,
            pooled,
        )


async def still_serving(rig: Rig) -> int:
    with trio.fail_after(STEP_GUARD_S):
        response: httpx.Response = await rig.edge.client.post(
            "/v1/chat/completions", json=chat(model="other")
        )
        assert response.json() == orjson.loads(GOOD_JSON)
        return response.status_code


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(answer=answers, stream=st.booleans())
def test_no_response_bytes_make_a_500_leak_a_lease_or_pool_a_broken_connection(
    rig: Rig, answer: bytes, stream: bool
) -> None:
    reusable = reference_verdict(answer)
    rig.answer = answer
    # Hold the connection open only when it can be judged: an answer the reference reads
    # as complete. Anything else is closed after it, so a truncated answer ends at once.
    rig.hold = reusable
    try:
        status, body, worker, inflight, pooled = rig.run(one_request, rig, stream)
    finally:
        rig.run(_close_held, rig)
    assert inflight == 0
    # 5xx and 429 fail over to the good worker; any other status is a worker's own answer.
    assert 200 <= status < 500 and status != 429, (status, body[:200])
    if worker == rig.edge.good.url:
        assert status == 200
    if pooled:
        assert reusable, answer
    if stream and status == 200 and worker == rig.edge.bad.url and b"event: error" in body:
        assert body.endswith(b"\n\n") and body.rindex(b"event: error") > body.rfind(b"data: [DONE]")


async def _close_held(rig: Rig) -> None:
    rig.close_held()
    await trio.lowlevel.checkpoint()


def test_the_router_still_serves_after_the_fuzz(rig: Rig) -> None:
    assert rig.run(still_serving, rig) == 200
    assert rig.run(_inflight_total, rig) == 0


async def _inflight_total(rig: Rig) -> int:
    await trio.lowlevel.checkpoint()
    return sum(worker.inflight for worker in rig.edge.router.fleet.workers())

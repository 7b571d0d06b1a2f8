"""The admission gate over real loopback sockets.

The worker here is a loopback server that holds every request until the test releases
it, so "the fleet is slow" is a fact the test controls rather than a race with a clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import orjson
import trio

from router.cli.serve import RunningRouter
from router.http.server.loop import serve_http
from router.http.server.messages import Request, ResponseWriter
from tests.support.http_client import RawClient
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

GUARD_S = 30
MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
# (status, Retry-After, error code) of an answer through the gate.
GateAnswer = tuple[int, str | None, str]
ANSWER = orjson.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"}}]})


class HeldWorker:
    """Answers 200 to each generation request once `release` is set; counts arrivals."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.received = 0
        self.holding = 0

    async def handle(self, request: Request, writer: ResponseWriter) -> None:
        if request.path == "/health":
            await writer.respond(200, [], b"")
            return
        if request.method != "POST":
            # What the router asks an engine of itself (its kind): nothing this worker serves.
            await writer.respond(404, [], b"")
            return
        self.received += 1
        self.holding += 1
        try:
            await self.release.wait()
        finally:
            self.holding -= 1
        await writer.respond(200, [(b"content-type", b"application/json")], ANSWER)


@asynccontextmanager
async def open_held_worker() -> AsyncIterator[tuple[HeldWorker, str]]:
    worker = HeldWorker()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, worker.handle))
        try:
            yield worker, f"http://127.0.0.1:{port}"
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_gate(
    *, client_limits: httpx.Limits | None = None, **overrides: Any
) -> AsyncIterator[tuple[HeldWorker, RunningRouter, httpx.AsyncClient]]:
    """A held worker, a router in front of it with the admission settings `overrides`,
    and a client of the router (with `client_limits`, httpx's default when None)."""
    limits = {} if client_limits is None else {"limits": client_limits}
    async with (
        open_held_worker() as (worker, url),
        open_router([f"{url},model={MODEL}"], **overrides) as router,
        httpx.AsyncClient(base_url=router.url, timeout=GUARD_S, **limits) as client,
    ):
        yield worker, router, client


async def chat_into(results: list[GateAnswer], client: httpx.AsyncClient) -> None:
    """One chat request; its status, Retry-After and error code (`""` for a 200) go
    into `results`."""
    response = await client.post("/v1/chat/completions", json=CHAT)
    code = response.json().get("error", {}).get("code", "") if response.status_code != 200 else ""
    results.append((response.status_code, response.headers.get("retry-after"), code))


def gate_of(router: RunningRouter) -> tuple[int, int]:
    stats = router.app.admission.statistics()
    return stats.active, stats.waiting


async def test_twenty_at_once_with_limit_4_and_queue_4_serve_8_and_refuse_12() -> None:
    results: list[GateAnswer] = []
    with trio.fail_after(GUARD_S):
        async with open_gate(
            max_concurrent_requests=4, queue_size=4, client_limits=httpx.Limits(max_connections=32)
        ) as (worker, router, client):
            send = partial(chat_into, results, client)
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(send)
                await wait_until(lambda: len(results) == 12 and worker.holding == 4)
                assert gate_of(router) == (4, 4)
                assert worker.received == 4
                worker.release.set()
            scrape = (await client.get("/metrics")).text
    assert sorted(status for status, _, _ in results) == [200] * 8 + [429] * 12
    assert all(
        retry_after == "1" and code == "queue_full"
        for status, retry_after, code in results
        if status == 429
    )
    assert worker.received == 8
    assert gate_of(router) == (0, 0)
    assert 'router_admission_refused_total{reason="queue_full"} 12.0' in scrape
    assert 'router_requests_total{model="-",route="chat",status="429"} 12.0' in scrape


async def test_waiters_past_the_queue_timeout_get_503_queue_timeout() -> None:
    results: list[GateAnswer] = []
    with trio.fail_after(GUARD_S):
        async with open_gate(
            max_concurrent_requests=1,
            queue_size=4,
            queue_timeout_s=0.3,
        ) as (worker, router, client):
            send = partial(chat_into, results, client)
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(send)
                await wait_until(lambda: len(results) == 2)
                worker.release.set()
    assert sorted(results) == [
        (200, None, ""),
        (503, "1", "queue_timeout"),
        (503, "1", "queue_timeout"),
    ]
    assert worker.received == 1
    assert router.app.admission.statistics().queue_timeout == 2


async def test_a_queued_client_that_disconnects_frees_its_place_at_once() -> None:
    with trio.fail_after(GUARD_S):
        async with open_gate(max_concurrent_requests=1, queue_size=1) as (worker, router, client):
            body = orjson.dumps(CHAT)
            headers = [("content-type", "application/json")]
            holder = await RawClient.connect(router.port)
            await holder.send_request("POST", "/v1/chat/completions", headers, body)
            await wait_until(lambda: worker.holding == 1)
            leaver = await RawClient.connect(router.port)
            await leaver.send_request("POST", "/v1/chat/completions", headers, body)
            await wait_until(lambda: gate_of(router) == (1, 1))
            # The line is full: one more is refused.
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 429
            await leaver.aclose()
            await wait_until(lambda: gate_of(router) == (1, 0))
            results: list[int] = []

            async def next_waiter() -> None:
                results.append((await client.post("/v1/chat/completions", json=CHAT)).status_code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(next_waiter)
                await wait_until(lambda: gate_of(router) == (1, 1))
                worker.release.set()
                first = await holder.read_response("POST")
            await holder.aclose()
    assert first.status == 200
    assert results == [200]
    # The leaver was never sent to the worker: the holder and the next waiter only.
    assert worker.received == 2
    assert router.app.admission.statistics().left_queue == 1

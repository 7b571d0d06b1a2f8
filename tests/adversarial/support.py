"""Shared pieces of the adversarial suite: a router in front of one fake worker, raw-socket
exchanges, and the invariant every case ends with.

The invariant (`assert_still_serving`): no lease left (every worker's in-flight count in
`/v1/workers` is 0), and the router still answers a normal request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import h11
import httpx
import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.fake_worker.settings import FakeWorkerSettings
from router.serve import RunningRouter
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_BODY = orjson.dumps(CHAT)
# A valid request to pipeline behind a hostile one: it must never be served.
FOLLOW_UP = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT_BODY), CHAT_BODY)
)


@dataclass
class Setup:
    router: RunningRouter
    worker: FakeWorkerHandle

    @property
    def port(self) -> int:
        return self.router.port

    @property
    def dispatches(self) -> int:
        """Generation requests that reached the worker."""
        return self.worker.worker.routing.dispatches


@asynccontextmanager
async def open_setup(
    worker: FakeWorkerSettings | None = None, **overrides: Any
) -> AsyncIterator[Setup]:
    """A router (settings `overrides`) in front of one fake worker."""
    async with open_fake_fleet([worker or FakeWorkerSettings()]) as fleet, open_router(
        [fleet[0].url], **overrides
    ) as router:
        yield Setup(router, fleet[0])


async def exchange(port: int, data: bytes) -> bytes:
    """Send `data` on a fresh connection and return every byte the router sends back until
    it closes the connection (the caller holds a `fail_after` guard)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError:
            pass
        return await read_until_closed(stream)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    received = []
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            break
        if not chunk:
            break
        received.append(chunk)
    return b"".join(received)


def statuses(data: bytes) -> list[int]:
    """The status of every complete response in `data`, in order (parsed by h11); -1 last
    when bytes follow an answer that said the connection closes."""
    conn = h11.Connection(h11.CLIENT)
    conn.receive_data(data)
    conn.receive_data(b"")
    found = []
    while True:
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "router")]))
        conn.send(h11.EndOfMessage())
        event = conn.next_event()
        while type(event) is h11.InformationalResponse:
            event = conn.next_event()
        if type(event) is not h11.Response:
            return found
        status = event.status_code
        while type(event) is not h11.EndOfMessage:
            event = conn.next_event()
            if event is h11.NEED_DATA or type(event) is h11.ConnectionClosed:
                return found
        found.append(status)
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            if conn.trailing_data[0]:
                found.append(-1)  # bytes after an answer that closes the connection
            return found
        conn.start_next_cycle()


async def workers_inflight(router: RunningRouter) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        listing = (await client.get("/v1/workers")).json()["workers"]
    return {entry["id"]: entry["inflight"] for entry in listing}


async def metric(router: RunningRouter, name: str) -> float:
    """The value of the unlabelled metric `name`, scraped from `/metrics`."""
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


async def assert_still_serving(setup: Setup) -> None:
    """No lease left anywhere, and a normal request is answered by the worker."""
    assert set((await workers_inflight(setup.router)).values()) == {0}
    before = setup.dispatches
    async with httpx.AsyncClient(base_url=setup.router.url, timeout=10) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert setup.dispatches == before + 1

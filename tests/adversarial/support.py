"""Shared pieces of the adversarial suite: a router in front of one fake worker, raw stub
workers in a mixed or a PD layout, raw-socket exchanges, and the invariant every case
ends with.

The invariant (`assert_still_serving`): no lease left (every worker's in-flight count in
`/v1/workers` is 0), and the router still answers a normal request.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.cli.serve import RunningRouter
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.http_client import read_until_closed
from tests.support.raw_upstream import Respond, open_raw_upstream
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
    async with (
        open_fake_fleet([worker or FakeWorkerSettings()]) as fleet,
        open_router([fleet[0].url], **overrides) as router,
    ):
        yield Setup(router, fleet[0])


# Each case of the request path runs against one mixed worker and against a PD pair.
LAYOUTS = pytest.mark.parametrize("pd", [False, True], ids=["mixed", "pd"])


@asynccontextmanager
async def open_stub_workers(
    responders: Sequence[Respond], *, model: str
) -> AsyncIterator[list[str]]:
    """Raw stub workers of `model`, answering with `responders`: one is a mixed worker,
    two are a prefill (bootstrap port 8998) and a decode worker. Yields their `--worker`
    specs."""
    if len(responders) == 1:
        async with open_raw_upstream(responders[0]) as mixed:
            yield [f"{mixed.url},model={model}"]
        return
    prefill_respond, decode_respond = responders
    async with (
        open_raw_upstream(prefill_respond) as prefill,
        open_raw_upstream(decode_respond) as decode,
    ):
        yield [
            f"{prefill.url},role=prefill,model={model},bootstrap_port=8998",
            f"{decode.url},role=decode,model={model}",
        ]


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


def statuses(data: bytes) -> list[int]:
    """The status of every response in `data`, in order; a response cut short still counts
    once its head is complete. -1 last when bytes follow that are not a response, or
    follow an answer that said the connection closes.

    Tolerant on purpose (h11's client would need the requests' methods): a response
    with a Content-Length whose body starts with another status line answered a HEAD.
    """
    found: list[int] = []
    position = 0
    while position < len(data):
        head = _RESPONSE_HEAD.match(data, position)
        if head is None:
            found.append(-1)
            return found
        status = int(head.group(1))
        found.append(status)
        position = head.end()
        fields = {
            name.strip().lower(): value.strip()
            for name, _, value in (
                line.partition(b":") for line in head.group(2).split(b"\r\n") if line
            )
        }
        if 100 <= status < 200 or status in (204, 304):
            continue
        if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            position = _skip_chunks(data, position)
        elif b"content-length" in fields:
            if not _RESPONSE_HEAD.match(data, position):
                position += int(fields[b"content-length"])
        else:
            position = len(data)
        if fields.get(b"connection", b"").lower() == b"close" and position < len(data):
            found.append(-1)
            return found
    return found


_RESPONSE_HEAD = re.compile(rb"HTTP/1\.[01] (\d{3})[^\r\n]*\r\n((?:[^\r\n]+\r\n)*)\r\n")
_CHUNK_SIZE = re.compile(rb"([0-9a-fA-F]+)[^\r\n]*\r\n")


def _skip_chunks(data: bytes, position: int) -> int:
    """The position after a chunked body starting at `position` (the end when cut short)."""
    while True:
        size = _CHUNK_SIZE.match(data, position)
        if size is None:
            return len(data)
        position = size.end()
        if int(size.group(1), 16) == 0:
            trailer_end = data.find(b"\r\n\r\n", position - 2)
            return len(data) if trailer_end < 0 else trailer_end + 4
        position += int(size.group(1), 16) + 2


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

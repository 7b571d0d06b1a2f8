"""A real router in front of one stub worker that misbehaves on purpose and one that does not.

Both workers serve model `m` (the bad one alone also serves `solo`, for requests that
must reach it); a third, healthy, serves model `other`, so a test can show the router
still serves after whatever the bad one did. Failover is on (two attempts),
the breaker off unless a test asks: the cost assertions are dispatch counts, retries,
leases (in-flight) and pooled connections.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from router.cli.serve import RunningRouter
from tests.support.raw_upstream import Exchange, RawUpstream, Respond, open_raw_upstream
from tests.support.router_instance import open_router

GOOD_JSON = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
    }
)
GOOD_EVENTS = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(3)] + [
    b"data: [DONE]\n\n"
]


def chat(stream: bool = False, model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": stream}


async def answer_well(exchange: Exchange) -> None:
    """A worker that does its job: JSON, or an SSE stream when asked; 200 to a health check."""
    if exchange.request.method != b"POST":
        await exchange.respond(200, [], b"")
    elif orjson.loads(exchange.body).get("stream"):
        await exchange.start(200, [(b"content-type", b"text/event-stream")])
        for event in GOOD_EVENTS:
            await exchange.send(event)
        await exchange.end()
    else:
        await exchange.respond(200, [(b"content-type", b"application/json")], GOOD_JSON)


class Dispatches:
    """Generation requests (POSTs) a stub received; health checks pass through `answer_well`."""

    def __init__(self, respond: Respond) -> None:
        self.count = 0
        self._respond = respond

    async def __call__(self, exchange: Exchange) -> None:
        if exchange.request.method != b"POST":
            await answer_well(exchange)
            return
        self.count += 1
        await self._respond(exchange)


@dataclass
class Edge:
    bad: RawUpstream
    good: RawUpstream
    other: RawUpstream
    router: RunningRouter
    client: httpx.AsyncClient
    bad_dispatches: Dispatches
    good_dispatches: Dispatches

    async def workers(self) -> dict[str, dict[str, Any]]:
        response = await self.client.get("/v1/workers")
        assert response.status_code == 200
        return {entry["url"]: entry for entry in response.json()["workers"]}

    async def counter(self, name: str) -> dict[str, float]:
        """A labelled counter's samples, keyed by their one label's value."""
        text = (await self.client.get("/metrics")).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    found[next(iter(sample.labels.values()), "")] = sample.value
        return found

    def pooled_to_bad(self) -> int:
        return self.router.app.generation.pool.statistics().idle_per_worker.get(self.bad.url, 0)

    async def assert_no_harm_left(self, *, bad_answers_were_valid: bool = False) -> None:
        """No lease held, nothing of the bad worker pooled (unless its answers were valid
        HTTP), and the router still serves."""
        workers = await self.workers()
        assert {self.bad.url, self.good.url, self.other.url} <= set(workers)
        assert {url: entry["inflight"] for url, entry in workers.items() if entry["inflight"]} == {}
        if not bad_answers_were_valid:
            assert self.pooled_to_bad() == 0
        answered = await self.client.post("/v1/chat/completions", json=chat(model="other"))
        assert answered.status_code == 200
        assert answered.json() == orjson.loads(GOOD_JSON)


@asynccontextmanager
async def open_edge(bad: Respond, **overrides: Any) -> AsyncIterator[Edge]:
    overrides.setdefault("max_attempts", 2)
    overrides.setdefault("breaker_failure_threshold", 0)
    overrides.setdefault("first_byte_timeout_s", 10.0)
    overrides.setdefault("stream_idle_timeout_s", 10.0)
    bad_dispatches = Dispatches(bad)
    good_dispatches = Dispatches(answer_well)
    async with (
        open_raw_upstream(bad_dispatches) as bad_worker,
        open_raw_upstream(good_dispatches) as good_worker,
        open_raw_upstream(answer_well) as other_worker,
        open_router(
            [
                f"{bad_worker.url},model=m+solo",
                f"{good_worker.url},model=m",
                f"{other_worker.url},model=other",
            ],
            **overrides,
        ) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as client,
    ):
        yield Edge(
            bad_worker, good_worker, other_worker, router, client, bad_dispatches, good_dispatches
        )

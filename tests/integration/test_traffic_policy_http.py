"""The traffic policy over real loopback sockets: priority order through the admission
queue, fair turns for a light tenant behind a flood, the 400 for a claim a key may not
make, and a tenant cap's refusal, each with what the worker received.

The worker holds the first request until the test lets it go and answers the rest at
once, recording the order it received them in (each request's message names it), so the
order the queue released them is a fact the test reads, not a race with a clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

from router.cli.serve import RunningRouter
from router.http.server.loop import serve_http
from router.http.server.messages import Request, ResponseWriter
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

GUARD_S = 30
MODEL = "m"
ANSWER = orjson.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"}}]})


class OrderWorker:
    """Holds requests until `release` is set; records each one's name in arrival order."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.received: list[str] = []
        self.bodies: list[bytes] = []
        self.holding = 0

    async def handle(self, request: Request, writer: ResponseWriter) -> None:
        if request.path == "/health":
            await writer.respond(200, [], b"")
            return
        if request.method != "POST":
            await writer.respond(404, [], b"")
            return
        self.received.append(orjson.loads(request.body)["messages"][0]["content"])
        self.bodies.append(request.body)
        self.holding += 1
        try:
            await self.release.wait()
        finally:
            self.holding -= 1
        await writer.respond(200, [(b"content-type", b"application/json")], ANSWER)


@asynccontextmanager
async def open_policy_router(
    **overrides: Any,
) -> AsyncIterator[tuple[OrderWorker, RunningRouter, httpx.AsyncClient]]:
    worker = OrderWorker()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, worker.handle))
        async with (
            open_router([f"http://127.0.0.1:{port},model={MODEL}"], **overrides) as router,
            httpx.AsyncClient(
                base_url=router.url, timeout=GUARD_S, limits=httpx.Limits(max_connections=64)
            ) as client,
        ):
            yield worker, router, client
        nursery.cancel_scope.cancel()


def _chat(name: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": name}]}


async def _send(
    client: httpx.AsyncClient, name: str, headers: dict[str, str], into: dict[str, int]
) -> None:
    response = await client.post("/v1/chat/completions", json=_chat(name), headers=headers)
    into[name] = response.status_code


def _waiting(router: RunningRouter) -> int:
    return router.app.admission.statistics().waiting


async def test_an_interactive_request_overtakes_queued_batch_ones() -> None:
    statuses: dict[str, int] = {}
    with trio.fail_after(GUARD_S):
        async with open_policy_router(
            max_concurrent_requests=1,
            priority_classes="interactive,batch",
            default_priority="interactive",
        ) as (worker, router, client):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send, client, "holder", {}, statuses)
                await wait_until(lambda: worker.holding == 1)
                for number in range(3):
                    batch = {"x-priority": "batch"}
                    nursery.start_soon(_send, client, f"batch{number}", batch, statuses)
                    await wait_until(lambda n=number: _waiting(router) == n + 1)  # type: ignore[misc]
                nursery.start_soon(_send, client, "interactive", {}, statuses)
                await wait_until(lambda: _waiting(router) == 4)
                worker.release.set()
            scrape = (await client.get("/metrics")).text
    assert worker.received == ["holder", "interactive", "batch0", "batch1", "batch2"]
    assert set(statuses.values()) == {200}
    assert 'router_admission_wait_seconds_count{class="interactive"} 2.0' in scrape
    assert 'router_admission_wait_seconds_count{class="batch"} 3.0' in scrape


async def test_a_light_tenant_behind_a_flood_is_served_next(tmp_path: Path) -> None:
    statuses: dict[str, int] = {}
    with trio.fail_after(GUARD_S):
        async with open_policy_router(
            max_concurrent_requests=1, tenant_header="x-tenant", queue_size=50
        ) as (worker, router, client):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send, client, "holder", {"x-tenant": "flood"}, statuses)
                await wait_until(lambda: worker.holding == 1)
                for number in range(10):
                    flood = {"x-tenant": "flood"}
                    nursery.start_soon(_send, client, f"flood{number}", flood, statuses)
                await wait_until(lambda: _waiting(router) == 10)
                nursery.start_soon(_send, client, "light", {"x-tenant": "light"}, statuses)
                await wait_until(lambda: _waiting(router) == 11)
                worker.release.set()
    assert worker.received[:3] == ["holder", worker.received[1], "light"]
    assert worker.received[1].startswith("flood")
    assert len(worker.received) == 12


async def test_a_claim_the_key_may_not_make_is_a_400_that_reaches_no_worker(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("nightly: {key: key-of-nightly, priority: batch}\n")
    keys.chmod(0o600)
    with trio.fail_after(GUARD_S):
        async with open_policy_router(
            api_keys_file=str(keys),
            priority_classes="interactive,batch",
            default_priority="interactive",
        ) as (worker, _, client):
            worker.release.set()
            headers = {"authorization": "Bearer key-of-nightly", "x-priority": "interactive"}
            refused = await client.post("/v1/chat/completions", json=_chat("x"), headers=headers)
            headers["x-priority"] = "batch"
            served = await client.post("/v1/chat/completions", json=_chat("y"), headers=headers)
            garbage = await client.post(
                "/v1/chat/completions",
                json=_chat("z"),
                headers=[
                    (b"authorization", b"Bearer key-of-nightly"),
                    (b"x-priority", "\u00e9lite".encode()),
                ],
            )
            scrape = (
                await client.get("/metrics", headers={"authorization": "Bearer key-of-nightly"})
            ).text
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "priority_not_allowed"
    assert "key 'nightly' may claim priority 'batch' or below" in refused.json()["error"]["message"]
    assert garbage.status_code == 400
    assert garbage.json()["error"]["code"] == "invalid_priority"
    assert served.status_code == 200
    assert worker.received == ["y"]
    assert 'router_requests_total{key="nightly",model="-",route="chat",status="400"} 2.0' in scrape


async def test_a_tenant_at_its_queue_cap_gets_429_naming_it() -> None:
    statuses: dict[str, int] = {}
    with trio.fail_after(GUARD_S):
        async with open_policy_router(
            max_concurrent_requests=1, tenant_header="x-tenant", tenant_max_queued=1
        ) as (worker, router, client):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send, client, "holder", {"x-tenant": "a"}, statuses)
                await wait_until(lambda: worker.holding == 1)
                nursery.start_soon(_send, client, "a1", {"x-tenant": "a"}, statuses)
                await wait_until(lambda: _waiting(router) == 1)
                refused = await client.post(
                    "/v1/chat/completions", json=_chat("a2"), headers={"x-tenant": "a"}
                )
                # Another tenant still has its own place in line.
                nursery.start_soon(_send, client, "b1", {"x-tenant": "b"}, statuses)
                await wait_until(lambda: _waiting(router) == 2)
                worker.release.set()
            scrape = (await client.get("/metrics")).text
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    body = refused.json()["error"]
    assert body["code"] == "queue_full"
    assert (
        "tenant 'a' of the client without a key already has 1 requests waiting" in body["message"]
    )
    assert statuses == {"holder": 200, "a1": 200, "b1": 200}
    assert "a2" not in worker.received
    assert 'router_admission_refused_total{reason="tenant_queue_full"} 1.0' in scrape


async def test_the_class_reaches_engines_as_priority_only_when_they_schedule_by_it() -> None:
    classes = {"priority_classes": "interactive,standard,batch", "default_priority": "standard"}
    # The client's own `priority` member, spelled with an escape, is the router's to set.
    body = b'{"model": "m", "\\u0070riority": 7, "messages": [{"role": "user", "content": "x"}]}'
    headers = {"content-type": "application/json", "x-priority": "batch"}
    with trio.fail_after(GUARD_S):
        async with open_policy_router(**classes, engine_priority_scheduling=True) as (
            worker,
            _,
            client,
        ):
            worker.release.set()
            await client.post("/v1/chat/completions", json=_chat("default"))
            await client.post("/v1/chat/completions", content=body, headers=headers)
            scheduled = list(worker.bodies)
        async with open_policy_router(**classes) as (worker, _, client):
            worker.release.set()
            await client.post("/v1/chat/completions", content=body, headers=headers)
            verbatim = list(worker.bodies)
    assert orjson.loads(scheduled[0])["priority"] == 1
    assert scheduled[1].startswith(b'{"priority":2,"model": "m",')
    assert orjson.loads(scheduled[1])["priority"] == 2
    assert verbatim == [body]

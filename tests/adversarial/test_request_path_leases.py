"""Every lease is released on every path through a real router over loopback, mixed and PD:
a client that leaves mid-request, a worker that breaks, and a half-open probe whose
client leaves. After each, `/v1/workers` shows in-flight 0, no probe is held, and the
router still serves.

The workers are raw stubs whose answers the test scripts: `hold` keeps a request unanswered
until released, `break_next` closes the connection without a word.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import trio

from router.cli.serve import RunningRouter
from router.fleet.breaker import BreakerState
from tests.adversarial.support import LAYOUTS, open_stub_workers
from tests.support.http_client import RawClient
from tests.support.raw_upstream import Exchange
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

MODEL = "m"
OK = orjson.dumps({"choices": [{"message": {"content": "hello"}}]})
CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
COOLDOWN_S = 1.0


@dataclass
class Stub:
    hold: bool = False
    break_next: int = 0
    fail_next: int = 0
    received: int = 0
    arrived: trio.Event = field(default_factory=trio.Event)
    release: trio.Event = field(default_factory=trio.Event)

    async def respond(self, exchange: Exchange) -> None:
        if exchange.request.method != b"POST":
            await exchange.respond(200, [], b"")
            return
        self.received += 1
        self.arrived.set()
        if self.break_next:
            self.break_next -= 1
            exchange.close()
            return
        if self.fail_next:
            self.fail_next -= 1
            await exchange.respond(
                503, [(b"content-type", b"application/json")], b'{"error":"busy"}'
            )
            return
        if self.hold:
            await self.release.wait()
        await exchange.respond(200, [(b"content-type", b"application/json")], OK)


@dataclass
class Setup:
    router: RunningRouter
    port: int
    client: httpx.AsyncClient
    stubs: list[Stub]

    async def workers(self) -> list[dict[str, Any]]:
        return (await self.client.get("/v1/workers")).json()["workers"]  # type: ignore[no-any-return]

    async def wait_released(self) -> None:
        """Every worker back at in-flight 0 with no probe in flight, as `/v1/workers` says."""

        def released() -> bool:
            now = trio.current_time()
            return all(
                worker.inflight == 0
                and worker.breaker is not None
                and not worker.breaker.statistics(now).probe_in_flight
                for worker in self.router.fleet.workers()
            )

        await wait_until(released)
        entries = await self.workers()
        assert [entry["inflight"] for entry in entries] == [0] * len(self.stubs)
        assert all(
            entry["breaker"]["state"] == "closed" or entry["breaker"]["next_probe_in_s"] is not None
            for entry in entries
        )

    async def assert_serving(self) -> None:
        for stub in self.stubs:
            stub.hold, stub.break_next, stub.fail_next = False, 0, 0
            stub.release.set()
        before = [stub.received for stub in self.stubs]
        response = await self.client.post("/v1/chat/completions", content=CHAT)
        assert response.status_code == 200, response.text
        assert [stub.received for stub in self.stubs] == [count + 1 for count in before]
        assert all(entry["inflight"] == 0 for entry in await self.workers())


@asynccontextmanager
async def setup(pd: bool, **overrides: Any) -> AsyncIterator[Setup]:
    stubs = [Stub(), Stub()] if pd else [Stub()]
    async with (
        open_stub_workers([stub.respond for stub in stubs], model=MODEL) as specs,
        open_router(specs, max_attempts=1, **overrides) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as client,
    ):
        yield Setup(router, router.port, client, stubs)


async def leave_mid_request(port: int, stubs: list[Stub]) -> None:
    """A raw client sends a request, waits until every worker has it, and hangs up."""
    raw = await RawClient.connect(port)
    await raw.send_request(
        "POST", "/v1/chat/completions", [("content-type", "application/json")], CHAT
    )
    for stub in stubs:
        await stub.arrived.wait()
    await raw.aclose()


@LAYOUTS
async def test_a_client_that_leaves_mid_request_leaves_no_lease_and_no_upstream_connection(
    pd: bool,
) -> None:
    with trio.fail_after(30):
        async with setup(pd) as s:
            for stub in s.stubs:
                stub.hold = True
            await leave_mid_request(s.port, s.stubs)
            await s.wait_released()
            # The held upstream connection(s) were closed, none kept or returned to the pool.
            pool = s.router.app.generation.pool.statistics()
            assert (pool.in_use, pool.idle_total, pool.closed) == (0, 0, len(s.stubs))
            await s.assert_serving()


@LAYOUTS
async def test_a_worker_that_breaks_leaves_no_lease_and_a_502(pd: bool) -> None:
    with trio.fail_after(30):
        async with setup(pd) as s:
            s.stubs[-1].break_next = 1
            response = await s.client.post("/v1/chat/completions", content=CHAT)
            assert response.status_code == 502
            await s.wait_released()
            await s.assert_serving()


@LAYOUTS
async def test_a_probe_whose_client_leaves_frees_the_probe_slot(pd: bool) -> None:
    """Breaker threshold 1: one 503 opens the decode (or mixed) worker; after the cooldown
    the next request is its probe, and its client leaves while it is held. The slot must
    be free again, so the request after it probes and closes the breaker."""
    with trio.fail_after(30):
        async with setup(pd, breaker_failure_threshold=1, breaker_cooldown_s=COOLDOWN_S) as s:
            target = s.stubs[-1]
            target.fail_next = 1
            response = await s.client.post("/v1/chat/completions", content=CHAT)
            assert response.status_code == 503
            assert (await s.workers())[-1]["breaker"]["state"] == "open"
            # Wait out the cooldown (real time: the router runs on the real clock here).
            decode = s.router.fleet.workers()[-1]
            assert decode.breaker is not None
            await wait_until(
                lambda: decode.breaker.state(trio.current_time()) is BreakerState.HALF_OPEN
            )  # type: ignore[union-attr]
            for stub in s.stubs:
                stub.hold = True
                stub.arrived = trio.Event()
            await leave_mid_request(s.port, s.stubs)
            await s.wait_released()
            breaker = (await s.workers())[-1]["breaker"]
            assert breaker["state"] == "half_open"
            assert breaker["next_probe_in_s"] == 0  # the slot is free: the next request probes
            await s.assert_serving()
            assert (await s.workers())[-1]["breaker"]["state"] == "closed"

"""Two router replicas in front of the same fake engines: each sees the other's requests
through the engines' own load, and routes around them."""

from __future__ import annotations

import httpx
import trio

from router.cli.serve import RunningRouter
from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

GUARD_S = 30
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}


async def complete(client: httpx.AsyncClient, router: RunningRouter) -> None:
    await client.post(router.url + "/v1/completions", json=BODY)


def engine_load(router: RunningRouter, url: str) -> float | None:
    worker = router.fleet.get(url)
    share = None if worker is None else worker.engine_share()
    return None if share is None else share[0]


async def test_a_replica_routes_around_the_engine_another_replica_filled() -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(2, engine="vllm", tokens=2) as (busy, free):
            busy.worker.hold_answers()
            specs = [f"{busy.url},model=fake-model", f"{free.url},model=fake-model"]
            async with (
                open_router(specs[:1], policy="least_load") as other,
                open_router(specs, policy="least_load", engine_load_interval_s=0.05) as router,
                httpx.AsyncClient(timeout=10) as client,
                # The held requests wait for the whole test (under the guard), however slow.
                httpx.AsyncClient(timeout=GUARD_S) as holder,
                trio.open_nursery() as held,
            ):
                # The other replica fills `busy` with four requests that stay in flight.
                for _ in range(4):
                    held.start_soon(complete, holder, other)
                await wait_until(lambda: busy.worker.routing.dispatches == 4)
                await wait_until(lambda: engine_load(router, busy.url) == 4.0)
                # This replica has nothing in flight anywhere, yet sends nothing to `busy`.
                for _ in range(6):
                    answer = await client.post(router.url + "/v1/completions", json=BODY)
                    assert answer.status_code == 200
                assert (busy.worker.routing.dispatches, free.worker.routing.dispatches) == (4, 6)
                metrics = (await client.get(router.url + "/metrics")).text
                assert f'router_worker_engine_load{{worker="{busy.url}"}} 4.0' in metrics
                assert f'router_worker_load{{worker="{busy.url}"}} 4.0' in metrics
                listing = (await client.get(router.url + "/v1/workers")).json()["workers"]
                by_url = {entry["url"]: entry for entry in listing}
                assert by_url[busy.url]["engine_load"]["requests"] == 4.0
                assert by_url[busy.url]["load"] == 4.0
                busy.worker.release_answers()


async def test_without_the_engines_load_a_replica_sends_into_the_filled_engine() -> None:
    # The same fleet read by this replica's own count alone: what the test above rules out.
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(2, engine="vllm", tokens=2) as (busy, free):
            busy.worker.hold_answers()
            specs = [f"{busy.url},model=fake-model", f"{free.url},model=fake-model"]
            async with (
                open_router(specs[:1], policy="least_load") as other,
                open_router(specs, policy="least_load", engine_load_interval_s=0) as router,
                httpx.AsyncClient(timeout=10) as client,
                # The held requests wait for the whole test (under the guard), however slow.
                httpx.AsyncClient(timeout=GUARD_S) as holder,
                trio.open_nursery() as held,
            ):
                for _ in range(4):
                    held.start_soon(complete, holder, other)
                await wait_until(lambda: busy.worker.routing.dispatches == 4)
                with trio.move_on_after(2):
                    async with trio.open_nursery() as sends:
                        for _ in range(4):
                            sends.start_soon(complete, client, router)
                assert busy.worker.routing.dispatches > 4
                assert engine_load(router, busy.url) is None
                busy.worker.release_answers()

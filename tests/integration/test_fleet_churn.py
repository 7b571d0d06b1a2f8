"""1,000 workers come and go: afterwards the router holds state only for those present.

A real router on loopback, a stub worker behind every URL (each worker its own path
prefix, so each is its own pool endpoint), the fleet driven through discovery's own
`FleetMirror` with PUT and DELETE events and a relist. Each worker serves a request
before it leaves, so each had a pool endpoint with an idle connection, a DP rank
rotation, and (every other one) a breaker trip series.
"""

from __future__ import annotations

import httpx
import orjson
import trio

from router.discovery.etcd import FleetMirror
from router.discovery.etcd_client import KeyValue, WatchEvent
from tests.support.churn import answer_by_path, worker_series
from tests.support.raw_upstream import Exchange, open_raw_upstream
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

WORKERS = 1000
STAYING = 5


def put(key: str, value: dict[str, object], revision: int) -> WatchEvent:
    return WatchEvent("PUT", key, orjson.dumps(value), revision)


async def test_state_and_series_are_held_only_for_workers_present() -> None:
    with trio.fail_after(300):
        async with (
            open_raw_upstream(answer_by_path) as upstream,
            open_router(breaker_failure_threshold=1, max_attempts=1) as router,
            httpx.AsyncClient(base_url=router.url, timeout=30) as client,
        ):
            mirror = FleetMirror(router.fleet, router.metrics.discovery)
            records = {
                f"/w/{i}": {
                    "id": f"w{i}",
                    "url": f"{upstream.url}/w{i}",
                    "model": "m",
                    "dp_size": 2,
                }
                for i in range(WORKERS)
            }
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            revision = 1
            for i, (key, value) in enumerate(records.items()):
                revision += 1
                mirror.apply(put(key, value, revision))
                response = await client.post("/v1/chat/completions", json=body)
                if i < WORKERS - STAYING * 2:  # alone in the fleet: it served the request
                    assert response.status_code == (500 if i % 2 else 200)
                    assert response.headers["x-router-worker"] == f"w{i}"
                    revision += 1
                    mirror.apply(WatchEvent("DELETE", key, b"", revision))
            # The rest leave by a relist that keeps only the last STAYING.
            present = list(records.items())[-STAYING:]
            mirror.relist(
                [KeyValue(key, orjson.dumps(value), revision, 0) for key, value in present],
                revision,
            )
            present_ids = {str(value["id"]) for _, value in present}
            present_urls = {str(value["url"]) for _, value in present}

            assert {worker.id for worker in router.fleet.workers()} == present_ids
            assert len(router.app.generation.ranks) <= STAYING
            pool = router.app.generation.pool
            stats = pool.statistics()
            assert set(stats.idle_per_worker) <= present_urls
            assert stats.idle_total <= STAYING and stats.in_use == 0
            for i in range(WORKERS - STAYING):
                assert not pool.forget(f"{upstream.url}/w{i}"), f"the pool still held w{i}"
            # Every departed worker's connection was closed by the router, none left open.
            # (the stub sees each close a moment later; fail_after bounds the wait)
            await upstream.wait_ended(upstream.accepted - STAYING)

            scrape = (await client.get("/metrics")).text
            for metric in (
                "router_worker_breaker_trips_total",
                "router_worker_inflight",
                "router_worker_healthy",
                "router_worker_breaker_state",
            ):
                assert worker_series(scrape, metric) <= present_ids, metric
            assert worker_series(
                scrape, "router_worker_breaker_trips_total"
            )  # the odd ones still present
            workers = (await client.get("/v1/workers")).json()["workers"]
            assert sorted(entry["id"] for entry in workers) == sorted(present_ids)
            assert all(entry["inflight"] == 0 for entry in workers)


async def test_a_worker_whose_last_request_fails_after_it_left_gets_no_series_back() -> None:
    """Its breaker trips after the fleet let go of it: no trips series is created again,
    and its URL is dropped from the pool once that request ends."""
    release = trio.Event()
    arrived = trio.Event()

    async def slow_failure(exchange: Exchange) -> None:
        arrived.set()
        await release.wait()
        await exchange.respond(500, [(b"content-type", b"application/json")], b"{}")

    with trio.fail_after(30):
        async with (
            open_raw_upstream(slow_failure) as upstream,
            open_router(breaker_failure_threshold=1, max_attempts=1) as router,
            httpx.AsyncClient(base_url=router.url, timeout=30) as client,
            trio.open_nursery() as nursery,
        ):
            mirror = FleetMirror(router.fleet, router.metrics.discovery)
            # The engine is named, so the router asks it nothing of itself: this upstream
            # holds whatever reaches it, and only the chat request may.
            record = {"id": "w0", "url": upstream.url, "model": "m", "engine": "sglang"}
            mirror.apply(put("/w/0", record, 2))
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            statuses: list[int] = []

            async def send() -> None:
                statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)

            nursery.start_soon(send)
            await arrived.wait()
            mirror.apply(WatchEvent("DELETE", "/w/0", b"", 3))
            assert router.fleet.get("w0") is None
            release.set()
            await wait_until(lambda: statuses == [500])
            scrape = (await client.get("/metrics")).text
            assert worker_series(scrape, "router_worker_breaker_trips_total") == set()
            pool = router.app.generation.pool
            assert pool.statistics().idle_total == 0
            assert not pool.forget(upstream.url)  # already dropped when the request ended

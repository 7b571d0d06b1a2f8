"""Workers come and go through a real etcd: afterwards the router holds pool endpoints,
DP rank state and per-worker series only for those present (the 1,000-worker version
drives discovery's `FleetMirror` directly: tests/integration/test_fleet_churn.py)."""

from __future__ import annotations

import httpx
import orjson
import pytest
import trio

from router.discovery.etcd_client import open_etcd_client
from tests.support.churn import answer_by_path, worker_series
from tests.support.etcd_server import EtcdServer
from tests.support.raw_upstream import open_raw_upstream
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
PREFIX = "/churn/workers/"
WORKERS = 40
STAYING = 3


async def test_workers_that_leave_through_etcd_leave_no_state_behind(etcd: EtcdServer) -> None:
    with trio.fail_after(120):
        async with (
            open_raw_upstream(answer_by_path) as upstream,
            open_etcd_client(etcd.url) as etcd_client,
            open_router(
                discovery="etcd",
                etcd_endpoint=etcd.url,
                etcd_prefix=PREFIX,
                breaker_failure_threshold=1,
                max_attempts=1,
            ) as router,
            httpx.AsyncClient(base_url=router.url, timeout=30) as client,
        ):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for i in range(WORKERS):
                record = {"id": f"w{i}", "url": f"{upstream.url}/w{i}", "model": "m", "dp_size": 2}
                await etcd_client.put(f"{PREFIX}w{i}", orjson.dumps(record))
                await wait_until(lambda i=i: router.fleet.get(f"w{i}") is not None)  # type: ignore[misc]
                response = await client.post("/v1/chat/completions", json=body)
                assert response.headers["x-router-worker"] == f"w{i}"
                assert response.status_code == (500 if i % 2 else 200)
                if i < WORKERS - STAYING:
                    await etcd_client.delete(f"{PREFIX}w{i}")
                    await wait_until(lambda i=i: router.fleet.get(f"w{i}") is None)  # type: ignore[misc]

            present = {f"w{i}" for i in range(WORKERS - STAYING, WORKERS)}
            assert {worker.id for worker in router.fleet.workers()} == present
            assert len(router.app.generation.ranks) == STAYING
            stats = router.app.generation.pool.statistics()
            assert set(stats.idle_per_worker) == {
                f"{upstream.url}/{worker_id}" for worker_id in present
            }
            scrape = (await client.get("/metrics")).text
            assert worker_series(scrape, "router_worker_breaker_trips_total") == {"w37", "w39"}
            assert worker_series(scrape, "router_worker_inflight") == present
            await upstream.wait_ended(upstream.accepted - STAYING)

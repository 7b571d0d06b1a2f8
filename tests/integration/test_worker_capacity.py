"""Per-worker in-flight caps and waiting for workers, over real loopback sockets.

The fake workers count the requests they hold at once themselves (`peak_inflight`), so
the cap is checked where it matters: at the worker, not in the router's own books.
"""

from __future__ import annotations

from functools import partial

import httpx
import trio

from router.fake_worker.settings import FakeWorkerSettings
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import MODEL, open_etcd_router, record_for, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

GUARD_S = 60
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


async def test_no_worker_ever_holds_more_than_its_cap_and_the_faster_serves_more() -> None:
    fast = FakeWorkerSettings(ttft_ms=10, tokens=2)
    slow = FakeWorkerSettings(ttft_ms=150, tokens=2)
    traffic = Traffic()
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([fast, slow]) as fleet:
            specs = [f"{handle.url},model={MODEL}" for handle in fleet]
            async with (
                open_router(specs, worker_max_inflight=2) as router,
                httpx.AsyncClient(
                    base_url=router.url, timeout=GUARD_S, limits=httpx.Limits(max_connections=16)
                ) as client,
            ):
                send = partial(client.post, "/v1/chat/completions", json=CHAT)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(traffic.keep_sending, send, clients=10, most=4))
                    # Ten clients, four slots: the router holds the rest in line.
                    await wait_until(lambda: router.app.generation.waits.waiting() > 0)
                scrape = (await client.get("/metrics")).text
    fast_stats, slow_stats = (handle.worker.routing for handle in fleet)
    assert traffic.statuses() == [200] * 40
    assert fast_stats.peak_inflight <= 2 and slow_stats.peak_inflight <= 2
    assert fast_stats.peak_inflight == 2  # the cap was reached, so it was what held
    assert fast_stats.dispatches + slow_stats.dispatches == 40
    assert fast_stats.dispatches > slow_stats.dispatches
    assert 'router_worker_waits_total{outcome="served"}' in scrape


async def test_the_only_worker_replaced_while_requests_flow_loses_nothing(etcd: EtcdServer) -> None:
    traffic = Traffic()
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(2, tokens=2) as fleet,
            trio.open_nursery() as nursery,
        ):
            old = await register(nursery, etcd.url, record_for("old", fleet[0].url), lease_ttl_s=30)
            async with (
                open_etcd_router(etcd.url, wait_for_workers_s=10.0) as router,
                httpx.AsyncClient(base_url=router.url, timeout=GUARD_S) as client,
            ):
                await wait_until(lambda: router.fleet.get("old") is not None)
                stop = trio.Event()
                send = partial(client.post, "/v1/chat/completions", json=CHAT)
                flow = partial(traffic.keep_steady_flow, send, stop=stop, within_s=GUARD_S)
                async with trio.open_nursery() as flows:
                    flows.start_soon(flow)
                    await wait_until(lambda: len(traffic.answers) >= 6)
                    # The old worker drains and leaves; its replacement registers 3 s later.
                    assert await old.registration.announce_draining()
                    assert await old.registration.deregister()
                    old.crash()
                    await wait_until(lambda: router.fleet.get("old") is None)
                    gone_at = len(traffic.answers)
                    await trio.sleep(3.0)  # the replacement's start-up time, as the scenario says
                    await register(
                        nursery, etcd.url, record_for("new", fleet[1].url), lease_ttl_s=30
                    )
                    await wait_until(lambda: traffic.served_by("new") >= 6)
                    stop.set()
            nursery.cancel_scope.cancel()
    assert all(status == 200 for status in traffic.statuses()), traffic.failures
    assert set(traffic.workers()) == {"old", "new"}
    # Every request sent in the gap waited and was served by the replacement.
    assert all(worker == "new" for worker in traffic.workers()[gone_at + 3 :])
    assert fleet[1].worker.routing.dispatches == traffic.served_by("new")

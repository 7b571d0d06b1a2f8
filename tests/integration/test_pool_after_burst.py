"""The upstream pool after a burst: bounded idle connections, reused by the traffic after it.

A pool that walks its pooled connections on each request (httpcore's does) serves c1
traffic an order of magnitude slower once a burst has left hundreds of idle connections
behind; that cost is measured by `bench`, not here. This test holds the pool's state to
what an O(1) pool leaves: its bound kept, every later request on a pooled connection.
"""

from __future__ import annotations

import orjson
import trio

from router.fake_worker.settings import FakeWorkerSettings
from router.http.upstream.pool import PoolStatistics, UpstreamPool
from tests.support.fake_fleet import open_fake_fleet
from tests.support.http_client import RawClient
from tests.support.router_instance import open_router

BURST = 256
IDLE_BOUND = 128
C1_REQUESTS = 50
BODY = orjson.dumps(
    {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
)
HEADERS = [("content-type", "application/json")]


async def _c1_traffic(client: RawClient) -> None:
    """C1_REQUESTS sequential requests on one kept-alive connection."""
    for _ in range(C1_REQUESTS):
        response = await client.request("POST", "/v1/chat/completions", HEADERS, BODY)
        assert response.status == 200


async def _settled(pool: UpstreamPool) -> PoolStatistics:
    """The pool's statistics once no request holds a connection.

    The router answers its client before it hands the upstream connection back, so a
    client can see its answer a moment before the pool sees the connection again.
    """
    while True:
        stats = pool.statistics()
        if stats.in_use == 0:
            return stats
        await trio.sleep(0.001)


async def _one_of_the_burst(port: int, statuses: list[int]) -> None:
    client = await RawClient.connect(port)
    try:
        statuses.append(
            (await client.request("POST", "/v1/chat/completions", HEADERS, BODY)).status
        )
    finally:
        await client.aclose()


async def test_after_a_burst_the_pool_keeps_its_bound_and_reuses_it() -> None:
    with trio.fail_after(60):
        async with (
            open_fake_fleet([FakeWorkerSettings()]) as fleet,
            open_router(
                [fleet[0].url],
                pool_max_idle_per_worker=IDLE_BOUND,
                # No expiry during the test: the pool's size after the burst is the point.
                pool_idle_expiry_s=600,
            ) as router,
        ):
            pool = router.app.generation.pool
            c1 = await RawClient.connect(router.port)
            await _c1_traffic(c1)
            assert pool.statistics().opened == 1  # c1 traffic rides one pooled connection

            # Every answer waits until the whole burst is in flight at once, by the
            # worker's own count: an event, whatever the machine's load.
            fleet[0].worker.hold_answers(until=BURST)
            statuses: list[int] = []
            async with trio.open_nursery() as nursery:
                for _ in range(BURST):
                    nursery.start_soon(_one_of_the_burst, router.port, statuses)
            burst = await _settled(pool)

            await _c1_traffic(c1)
            settled = await _settled(pool)
            await c1.aclose()

    assert statuses == [200] * BURST
    assert fleet[0].worker.routing.peak_inflight == BURST
    assert fleet[0].worker.routing.dispatches == BURST + 2 * C1_REQUESTS
    # The burst needed far more connections than the pool may keep ...
    assert burst.opened > IDLE_BOUND + 1
    # ... and the pool kept exactly its bound of them, closing every other one.
    assert burst.idle_per_worker == {fleet[0].url: IDLE_BOUND}
    assert burst.opened - burst.closed == IDLE_BOUND
    # After the burst c1 traffic reuses pooled connections: no new one, no stale one.
    assert settled.opened == burst.opened
    assert settled.reused - burst.reused == C1_REQUESTS
    assert settled.stale_discarded == 0
    assert settled.idle_total == IDLE_BOUND

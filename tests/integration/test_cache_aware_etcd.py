"""A worker that leaves the fleet through etcd leaves the cache_aware tree with it: real
etcd, workers registered through the agent's registration code."""

from __future__ import annotations

import httpx
import pytest
import trio

from router.fleet.records import Role
from router.policies.cache_aware import CacheAware
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import MODEL, open_etcd_router, record_for, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
PROMPT = {
    "model": MODEL,
    "prompt": "a long shared prompt that one worker will hold. " * 20,
    "max_tokens": 1,
}


async def test_a_worker_deregistered_from_etcd_is_forgotten_by_the_tree(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(2, tokens=1) as fleet, trio.open_nursery() as nursery:
            registered = [
                await register(nursery, etcd.url, record_for(f"w{i}", w.url), lease_ttl_s=5)
                for i, w in enumerate(fleet)
            ]
            async with (
                open_etcd_router(etcd.url, policy="cache_aware") as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                await wait_until(lambda: len(router.fleet) == 2)
                served = {
                    (await client.post("/v1/completions", json=PROMPT)).headers["x-router-worker"]
                    for _ in range(3)
                }
                (holder,) = served
                policy = router.app.generation.policies[Role.MIXED]
                assert isinstance(policy, CacheAware)
                tree = policy.tree(MODEL, Role.MIXED)
                assert tree is not None and holder in tree.tenants()
                index = int(holder[1:])
                assert await registered[index].registration.deregister()
                await wait_until(lambda: router.fleet.get(holder) is None)
                left = policy.tree(MODEL, Role.MIXED)
                assert left is None or holder not in left.tenants()
                assert policy.statistics()["tree_chars"] == 0
            nursery.cancel_scope.cancel()

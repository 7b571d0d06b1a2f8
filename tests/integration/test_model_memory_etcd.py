"""A model whose only worker's etcd lease expired is a 503 with Retry-After while the
router remembers it, and a 404 only after `--model-memory-s`."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import MODEL, open_etcd_router, record_for, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
MEMORY_S = 3.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_briefly_empty_fleet_is_503_then_404_after_the_memory(etcd: EtcdServer) -> None:
    with trio.fail_after(60):
        async with (
            open_fake_fleet(1, tokens=2) as fleet,
            trio.open_nursery() as nursery,
            open_etcd_router(etcd.url, model_memory_s=MEMORY_S) as router,
            httpx.AsyncClient(base_url=router.url, timeout=10) as client,
        ):
            worker = await register(
                nursery, etcd.url, record_for("w0", fleet[0].url), lease_ttl_s=2
            )
            await wait_until(lambda: len(router.fleet) == 1)
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            worker.crash()  # no revoke: the key goes when its lease expires
            await wait_until(lambda: len(router.fleet) == 0)
            gone_at = trio.current_time()
            response = await client.post("/v1/chat/completions", json=CHAT)
            asked_at = trio.current_time()
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "no_available_workers"
            assert response.headers["retry-after"] == "1"
            assert asked_at - gone_at < MEMORY_S  # else the 503 above proves nothing
            assert "router_models_remembered 1.0" in (await client.get("/metrics")).text
            await trio.sleep_until(gone_at + MEMORY_S)  # the memory's end, on the router's clock
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "model_not_found"
            assert "router_models_remembered 0.0" in (await client.get("/metrics")).text

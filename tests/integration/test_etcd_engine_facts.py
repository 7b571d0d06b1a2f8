"""An etcd record of a prefill without a bootstrap address learns it from the engine, as a
static `--worker` does; until then the worker is pending, out of routing. A record without
`engine` learns the engine's kind while it routes; one that names it keeps it."""

from __future__ import annotations

import httpx
import pytest
import trio

from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import Role, WorkerRecord
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import MODEL, open_etcd_router, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_an_etcd_prefill_without_bootstrap_addr_learns_it_from_the_engine(
    etcd: EtcdServer,
) -> None:
    settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9777),
        FakeWorkerSettings(role="decode"),
    ]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (prefill, decode), trio.open_nursery() as nursery:
            # No disagg_meta: the record leaves the bootstrap port (and DP size) to the engine.
            await register(
                nursery,
                etcd.url,
                WorkerRecord("p", prefill.url, (MODEL,), Role.PREFILL),
                lease_ttl_s=5,
            )
            await register(
                nursery,
                etcd.url,
                WorkerRecord("d", decode.url, (MODEL,), Role.DECODE),
                lease_ttl_s=5,
            )
            async with open_etcd_router(etcd.url) as router:
                await wait_until(lambda: router.fleet.get("p") is not None)
                worker = router.fleet.get("p")
                assert worker is not None and worker.record.bootstrap_addr == "127.0.0.1:9777"
                async with httpx.AsyncClient(base_url=router.url) as client:
                    for _ in range(3):
                        assert (
                            await client.post("/v1/chat/completions", json=CHAT)
                        ).status_code == 200
            nursery.cancel_scope.cancel()
    assert [h["bootstrap_port"] for h in decode.worker.routing.handoffs] == [9777] * 3
    assert prefill.worker.routing.paths.get("/get_server_info") == 1


async def test_an_etcd_record_without_engine_learns_the_kind_and_an_explicit_one_wins(
    etcd: EtcdServer,
) -> None:
    settings = [FakeWorkerSettings(engine="vllm"), FakeWorkerSettings(engine="sglang")]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (vllm, sglang), trio.open_nursery() as nursery:
            await register(nursery, etcd.url, WorkerRecord("v", vllm.url, (MODEL,)), lease_ttl_s=5)
            # The record names its engine (wrongly, even): the record wins, nothing is asked.
            await register(
                nursery,
                etcd.url,
                WorkerRecord("s", sglang.url, (MODEL,), engine="vllm"),
                lease_ttl_s=5,
            )
            async with open_etcd_router(etcd.url) as router:
                await wait_until(lambda: len(router.fleet) == 2 and not router.fleet.describing)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    listing = (await client.get("/v1/workers")).json()["workers"]
            nursery.cancel_scope.cancel()
    engines = {entry["id"]: entry["engine"] for entry in listing}
    assert engines == {"v": "vllm", "s": "vllm"}
    assert next(e for e in listing if e["id"] == "v")["max_model_len"] == {
        MODEL: vllm.worker.settings.max_model_len
    }
    assert vllm.worker.routing.paths.get("/version") == 1
    assert "/get_server_info" not in sglang.worker.routing.paths
    assert "/version" not in sglang.worker.routing.paths

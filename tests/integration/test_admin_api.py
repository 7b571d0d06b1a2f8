"""The admin API of a static fleet over loopback: add, drain, remove; refused without the
key, absent without the setting, and 409 when discovery owns the fleet."""

from __future__ import annotations

from functools import partial
from urllib.parse import quote

import httpx
import pytest
import trio

from tests.support.etcd_server import EtcdServer
from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

GUARD_S = 30
MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
ADMIN_KEY = "admin-secret-890"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


async def test_without_the_setting_the_admin_routes_do_not_exist() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([f"{fleet[0].url},model={MODEL}"]) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                added = await client.post(
                    "/v1/workers", json={"spec": "http://127.0.0.1:9"}, headers=ADMIN
                )
                drained = await client.post(f"/v1/workers/{fleet[0].url}/drain", headers=ADMIN)
                deleted = await client.delete(f"/v1/workers/{fleet[0].url}", headers=ADMIN)
                listing = await client.get("/v1/workers")
    assert (added.status_code, drained.status_code, deleted.status_code) == (404, 404, 404)
    assert listing.status_code == 200
    assert len(router.fleet) == 1


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {ADMIN_KEY}"])
async def test_a_wrong_admin_key_is_401_and_changes_nothing(authorization: str | None) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(2) as fleet,
            open_router([f"{fleet[0].url},model={MODEL}"], admin_api_key=ADMIN_KEY) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                added = await client.post(
                    "/v1/workers", json={"spec": f"{fleet[1].url},model={MODEL}"}, headers=headers
                )
                deleted = await client.delete(f"/v1/workers/{fleet[0].url}", headers=headers)
    assert (added.status_code, deleted.status_code) == (401, 401)
    assert [worker.id for worker in router.fleet.workers()] == [fleet[0].url]
    assert not router.fleet.workers()[0].draining


async def test_add_then_drain_then_delete_with_a_request_in_flight() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(2, tokens=2) as fleet,
            open_router([f"{fleet[0].url},model={MODEL}"], admin_api_key=ADMIN_KEY) as router,
            httpx.AsyncClient(base_url=router.url, timeout=GUARD_S) as client,
        ):
            # Add the second worker, in the `--worker` syntax, and as a JSON record a bad way.
            added = await client.post(
                "/v1/workers",
                json={"spec": f"{fleet[1].url},model={MODEL},id=second"},
                headers=ADMIN,
            )
            assert added.status_code == 201 and added.json()["id"] == "second"
            again = await client.post(
                "/v1/workers",
                json={"url": fleet[1].url, "id": "second", "model": MODEL},
                headers=ADMIN,
            )
            assert again.status_code == 409
            bad = await client.post("/v1/workers", content=b"{not json", headers=ADMIN)
            assert bad.status_code == 400
            for _ in range(4):
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert fleet[1].worker.routing.dispatches == 2

            # A slow request holds the second worker while it is drained.
            await client.post(f"{fleet[1].url}/debug/behaviour", json={"ttft_ms": 600})
            fleet[1].worker.routing.reset()
            results: list[int] = []
            async with trio.open_nursery() as nursery:

                async def slow_request() -> None:
                    for _ in range(2):  # round robin: one of two lands on the second worker
                        response = await client.post("/v1/chat/completions", json=CHAT)
                        results.append(response.status_code)

                nursery.start_soon(slow_request)
                await wait_until(lambda: fleet[1].worker.routing.inflight == 1)
                drain = await client.post("/v1/workers/second/drain", headers=ADMIN)
                assert drain.status_code == 202 and drain.json()["inflight"] == 1
                second = router.fleet.get("second")
                assert second is not None and second.draining
                for _ in range(3):
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                assert fleet[1].worker.routing.dispatches == 1  # nothing new reached it
                await wait_until(lambda: router.fleet.get("second") is None)
                assert fleet[1].worker.routing.inflight == 0  # removed only once idle
            assert results == [200, 200]

            deleted = await client.delete(
                f"/v1/workers/{quote(fleet[0].url, safe='')}", headers=ADMIN
            )
            assert deleted.status_code == 200 and deleted.json() == {
                "id": fleet[0].url,
                "removed": True,
            }
            missing = await client.delete("/v1/workers/nobody", headers=ADMIN)
            assert missing.status_code == 404
            assert len(router.fleet) == 0


async def test_with_discovery_on_the_admin_api_answers_409(etcd: EtcdServer) -> None:
    with trio.fail_after(GUARD_S):
        async with open_router(
            discovery="etcd",
            etcd_endpoint=etcd.url,
            etcd_prefix="/admin-test/",
            admin_api_key=ADMIN_KEY,
        ) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                added = await client.post(
                    "/v1/workers", json={"spec": "http://127.0.0.1:9,model=m"}, headers=ADMIN
                )
                deleted = await client.delete("/v1/workers/any", headers=ADMIN)
    assert (added.status_code, deleted.status_code) == (409, 409)
    assert added.json()["error"]["code"] == "conflict"
    assert len(router.fleet) == 0


async def test_a_rolling_update_through_the_admin_api_loses_no_request() -> None:
    traffic = Traffic()
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(2, tokens=2) as fleet,
            open_router(
                [f"{fleet[0].url},model={MODEL},id=old"],
                admin_api_key=ADMIN_KEY,
                wait_for_workers_s=10.0,
            ) as router,
            httpx.AsyncClient(base_url=router.url, timeout=GUARD_S) as client,
        ):
            stop = trio.Event()
            send = partial(client.post, "/v1/chat/completions", json=CHAT)
            flow = partial(traffic.keep_steady_flow, send, stop=stop, within_s=GUARD_S)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(flow)
                await wait_until(lambda: len(traffic.answers) >= 6)
                assert (await client.delete("/v1/workers/old", headers=ADMIN)).status_code == 200
                await trio.sleep(3.0)  # the replacement's start-up time, as the scenario says
                spec = {"spec": f"{fleet[1].url},model={MODEL},id=new"}
                assert (
                    await client.post("/v1/workers", json=spec, headers=ADMIN)
                ).status_code == 201
                await wait_until(lambda: traffic.served_by("new") >= 6)
                stop.set()
    assert all(status == 200 for status in traffic.statuses()), traffic.failures
    assert set(traffic.workers()) == {"old", "new"}
    assert fleet[0].worker.routing.dispatches == traffic.served_by("old")


async def test_an_added_worker_may_not_set_its_own_status() -> None:
    with trio.fail_after(GUARD_S):
        async with open_router([], admin_api_key=ADMIN_KEY) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                record = {"url": "http://127.0.0.1:9", "model": MODEL, "status": "DRAINING"}
                refused = await client.post("/v1/workers", json=record, headers=ADMIN)
    assert refused.status_code == 400 and "status" in refused.json()["error"]["message"]
    assert len(router.fleet) == 0

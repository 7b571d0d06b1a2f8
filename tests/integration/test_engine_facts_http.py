"""Facts from the engine over real sockets: a prefill named without a bootstrap port
learns it from `/get_server_info`; one whose engine cannot state it is not admitted, and
`/v1/workers` says why."""

from __future__ import annotations

import itertools

import httpx
import trio

from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import open_fake_fleet
from tests.support.raw_upstream import Exchange, open_raw_upstream
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_prefill_without_bootstrap_port_learns_it_and_serves_pd() -> None:
    settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9123, dp_size=2),
        FakeWorkerSettings(role="decode"),
    ]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (prefill, decode):
            specs = [f"{prefill.url},role=prefill", f"{decode.url},role=decode"]
            async with open_router(specs) as router:
                await wait_until(lambda: router.fleet.get(prefill.url) is not None)
                worker = router.fleet.get(prefill.url)
                assert worker is not None
                assert worker.record.bootstrap_addr == "127.0.0.1:9123"
                assert worker.record.dp_size == 2  # learned with the port
                async with httpx.AsyncClient(base_url=router.url) as client:
                    for _ in range(4):
                        assert (
                            await client.post("/v1/chat/completions", json=CHAT)
                        ).status_code == 200
                    listing = (await client.get("/v1/workers")).json()["workers"]
            assert [h["bootstrap_port"] for h in decode.worker.routing.handoffs] == [9123] * 4
            assert prefill.worker.routing.ranks == {"0": 2, "1": 2}
            assert prefill.worker.routing.paths.get("/get_server_info") == 1  # asked once
            entry = next(e for e in listing if e["id"] == prefill.url)
            assert entry["disagg_meta"]["params"]["bootstrap_addr"] == "127.0.0.1:9123"


async def test_an_explicit_dp_size_wins_over_what_the_engine_says() -> None:
    settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9124, dp_size=2),
        FakeWorkerSettings(role="decode"),
    ]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (prefill, decode):
            specs = [f"{prefill.url},role=prefill,dp_size=1", f"{decode.url},role=decode"]
            async with open_router(specs) as router:
                await wait_until(lambda: router.fleet.get(prefill.url) is not None)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert prefill.worker.routing.ranks == {}  # dp_size 1: no rank header
            assert decode.worker.routing.handoffs[0]["bootstrap_port"] == 9124


async def test_a_worker_whose_facts_cannot_be_learned_is_not_admitted_and_says_why() -> None:
    # A mixed engine named as a prefill: its /get_server_info says disaggregation_mode "null".
    settings = [FakeWorkerSettings(role="mixed"), FakeWorkerSettings(role="decode")]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (wrong, decode):
            specs = [f"{wrong.url},role=prefill", f"{decode.url},role=decode"]
            async with open_router(specs) as router:
                await wait_until(
                    lambda: "disaggregation_mode" in router.fleet.pending[wrong.url].reason
                )
                async with httpx.AsyncClient(base_url=router.url) as client:
                    answer = await client.post("/v1/chat/completions", json=CHAT)
                    listing = (await client.get("/v1/workers")).json()["workers"]
                    scrape = (await client.get("/metrics")).text
            assert answer.status_code == 503, answer.text
            assert "prefill" in answer.json()["error"]["message"]
            entry = next(e for e in listing if e["id"] == wrong.url)
            assert entry["admitted"] is False and entry["status"] == "PENDING"
            assert "disaggregation_mode 'null'" in entry["reason"]
            assert "router_workers_pending 1.0" in scrape
            assert wrong.worker.routing.dispatches == 0 and decode.worker.routing.dispatches == 0


async def test_an_oversized_or_garbage_answer_costs_only_that_worker_and_is_asked_again_with_backoff() -> (
    None
):
    asked: list[float] = []

    async def respond(exchange: Exchange) -> None:
        asked.append(trio.current_time())
        if len(asked) == 1:
            await exchange.respond(
                200, [(b"content-type", b"application/json")], b"[" * (2 * 1024 * 1024)
            )
        else:
            await exchange.respond(200, [(b"content-type", b"application/json")], b"not json")

    with trio.fail_after(30):
        async with open_raw_upstream(respond) as upstream, open_fake_fleet(1) as (mixed,):
            specs = [f"{upstream.url},role=prefill,model=fake-model", mixed.url]
            async with open_router(specs) as router:
                await wait_until(lambda: len(asked) >= 3)
                reason = router.fleet.pending[upstream.url].reason
                async with httpx.AsyncClient(base_url=router.url) as client:
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert "is not JSON" in reason
            gaps = [later - earlier for earlier, later in itertools.pairwise(asked)]
            # backoff (0.5 s, then 1 s), not a tight loop; lower bounds only: load can add
            assert gaps[0] >= 0.45 and gaps[1] >= 0.95
            assert mixed.worker.routing.dispatches == 1

"""Facts from the engine over real sockets: a prefill named without a bootstrap port
learns it from `/get_server_info`; one whose engine cannot state it is not admitted, and
`/v1/workers` says why. A worker named without its engine's kind routes at once and is
listed with the kind its engine's answers show, or null when they fit neither."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import orjson
import trio

from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import EventEndpoint
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


def listed(listing: list[dict[str, Any]], worker_id: str) -> dict[str, Any]:
    return next(entry for entry in listing if entry["id"] == worker_id)


async def test_a_static_worker_of_each_kind_is_listed_as_its_engine_answers() -> None:
    settings = [FakeWorkerSettings(engine="sglang"), FakeWorkerSettings(engine="vllm")]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (sglang, vllm):
            # No engine= on either: the router must tell them apart from their answers.
            async with open_router([sglang.url, vllm.url]) as router:
                await wait_until(lambda: not router.fleet.describing)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    listing = (await client.get("/v1/workers")).json()["workers"]
                    for _ in range(4):
                        assert (
                            await client.post("/v1/chat/completions", json=CHAT)
                        ).status_code == 200
    assert listed(listing, sglang.url)["engine"] == "sglang"
    assert listed(listing, vllm.url)["engine"] == "vllm"
    # what only vLLM states is asked of vLLM only
    assert listed(listing, vllm.url)["max_model_len"] == {
        "fake-model": vllm.worker.settings.max_model_len
    }
    assert listed(listing, sglang.url)["max_model_len"] is None
    assert listed(listing, vllm.url)["kv_event_sources"] == []  # the fake publishes none
    assert sglang.worker.routing.paths.get("/get_server_info") == 1
    assert "/version" not in sglang.worker.routing.paths  # the server info decided
    assert vllm.worker.routing.paths.get("/version") == 1
    assert vllm.worker.routing.paths.get("/kv_event_sources") == 1
    # both routed meanwhile: the kind is not needed to route
    assert sglang.worker.routing.dispatches + vllm.worker.routing.dispatches == 4


async def test_an_explicit_engine_wins_and_is_not_asked() -> None:
    with trio.fail_after(30):
        async with open_fake_fleet([FakeWorkerSettings(engine="sglang")]) as (worker,):
            async with open_router([f"{worker.url},engine=vllm"]) as router:
                await wait_until(lambda: not router.fleet.describing)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    listing = (await client.get("/v1/workers")).json()["workers"]
    assert listed(listing, worker.url)["engine"] == "vllm"
    assert "/get_server_info" not in worker.worker.routing.paths  # the kind was given
    assert "/version" not in worker.worker.routing.paths


async def test_a_worker_whose_answers_fit_no_kind_stays_null_routes_and_is_asked_once() -> None:
    paths: list[str] = []

    async def respond(exchange: Exchange) -> None:
        target = exchange.request.target.decode()
        paths.append(target)
        json_headers = [(b"content-type", b"application/json")]
        if target == "/v1/chat/completions":
            body = b'{"id":"c","object":"chat.completion","choices":[],"model":"fake-model"}'
            await exchange.respond(200, json_headers, body)
        elif target == "/version":
            await exchange.respond(200, json_headers, b'{"version":"2.1","name":"other"}')
        else:
            await exchange.respond(404, json_headers, b'{"detail":"Not Found"}')

    with trio.fail_after(30):
        async with open_raw_upstream(respond) as upstream:
            async with open_router([f"{upstream.url},model=fake-model"]) as router:
                await wait_until(lambda: not router.fleet.describing)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    answer = await client.post("/v1/chat/completions", json=CHAT)
                    await trio.sleep(1.0)  # a second question would come within backoff
                    listing = (await client.get("/v1/workers")).json()["workers"]
    assert answer.status_code == 200, answer.text
    assert listed(listing, upstream.url)["engine"] is None
    assert listed(listing, upstream.url)["max_model_len"] is None
    assert paths.count("/get_server_info") == 1 and paths.count("/version") == 1


async def test_a_vllm_like_engine_states_max_model_len_and_its_kv_event_publishers() -> None:
    answers = {
        "/version": {"version": "0.32.0"},
        "/v1/models": {
            "object": "list",
            "data": [{"id": "fake-model", "object": "model", "max_model_len": 2048}],
        },
        "/kv_event_sources": {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558",
                "buffer_steps": 10000,
                "hwm": 100000,
                "max_queue_size": 100000,
                "topic": "",
            }
        },
    }

    async def respond(exchange: Exchange) -> None:
        target = exchange.request.target.decode()
        json_headers = [(b"content-type", b"application/json")]
        if target in answers:
            await exchange.respond(200, json_headers, orjson.dumps(answers[target]))
        else:
            await exchange.respond(404, json_headers, b'{"detail":"Not Found"}')

    with trio.fail_after(30):
        async with open_raw_upstream(respond) as upstream:
            async with open_router([upstream.url]) as router:
                await wait_until(lambda: not router.fleet.describing and len(router.fleet) == 1)
                worker = router.fleet.get(upstream.url)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    listing = (await client.get("/v1/workers")).json()["workers"]
    assert worker is not None and worker.engine == "vllm"
    assert worker.record.models == ("fake-model",)
    assert worker.record.max_model_len == {"fake-model": 2048}
    assert worker.record.kv_event_sources == (
        EventEndpoint(0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", ""),
    )
    entry = listed(listing, upstream.url)
    assert entry["engine"] == "vllm" and entry["max_model_len"] == {"fake-model": 2048}
    assert entry["kv_event_sources"] == [
        {
            "dp_rank": 0,
            "endpoint": "tcp://127.0.0.1:5557",
            "replay_endpoint": "tcp://127.0.0.1:5558",
            "topic": "",
        }
    ]

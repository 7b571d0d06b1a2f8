"""The request path over real loopback sockets: fake workers, the router, real clients."""

from __future__ import annotations

import dataclasses
import functools

import httpx
import openai
import orjson
import trio

from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import open_fake_fleet
from tests.support.http_client import RawClient
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


async def test_round_robin_spreads_30_requests_10_10_10() -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(3) as fleet, open_router([w.url for w in fleet]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                for _ in range(30):
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
                    assert response.headers["x-router-worker"] in {w.url for w in fleet}
            assert [w.worker.routing.dispatches for w in fleet] == [10, 10, 10]


def _openai_roundtrip(base_url: str) -> tuple[str, int, str]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    unary = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=7
    )
    streamed = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert unary.usage is not None
    return unary.choices[0].message.content or "", unary.usage.completion_tokens, text


async def test_openai_client_through_router_gets_the_workers_text() -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(1) as fleet, open_router([fleet[0].url]) as router:
            direct = await trio.to_thread.run_sync(_openai_roundtrip, fleet[0].url)
            routed = await trio.to_thread.run_sync(_openai_roundtrip, router.url)
    assert routed == direct
    assert routed[1] == 7
    assert routed[0] and routed[0] == routed[2]


async def test_least_load_sends_to_the_idle_worker() -> None:
    slow = FakeWorkerSettings(tokens=50, token_latency_ms=20)
    with trio.fail_after(30):
        async with (
            open_fake_fleet([slow, slow, slow]) as fleet,
            open_router([w.url for w in fleet], policy="least_load") as router,
        ):
            async with (
                httpx.AsyncClient(base_url=router.url, timeout=20) as client,
                trio.open_nursery() as nursery,
            ):
                slow_request = functools.partial(
                    client.post, "/v1/chat/completions", json={**CHAT, "max_tokens": 50}
                )
                for sent in (1, 2):
                    nursery.start_soon(slow_request)
                    # the next request is sent only once the router counts this one in flight
                    await wait_until(
                        lambda n=sent: sum(w.inflight for w in router.fleet.workers()) >= n
                    )
                busy = {w.id for w in router.fleet.workers() if w.inflight}
                response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
                assert response.status_code == 200
                assert response.headers["x-router-worker"] not in busy
    assert sorted(w.worker.routing.dispatches for w in fleet) == [1, 1, 1]


async def test_client_disconnect_mid_stream_reaches_the_worker_and_frees_inflight() -> None:
    slow = dataclasses.replace(FakeWorkerSettings(), tokens=200, token_latency_ms=20)
    with trio.fail_after(30):
        async with open_fake_fleet([slow]) as fleet, open_router([fleet[0].url]) as router:
            client = await RawClient.connect(router.port)
            body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 200})
            await client.send_request(
                "POST", "/v1/chat/completions", [("content-type", "application/json")], body
            )
            assert (await client.read_head("POST")).status == 200
            assert (await client.read_chunk() or b"").startswith(b"data: ")
            await client.aclose()
            left_at = trio.current_time()
            with trio.fail_after(1):
                await wait_until(lambda: fleet[0].worker.routing.disconnects >= 1)
            assert trio.current_time() - left_at < 1
            with trio.fail_after(1):
                await wait_until(lambda: router.fleet.workers()[0].inflight == 0)
            assert fleet[0].worker.routing.inflight == 0

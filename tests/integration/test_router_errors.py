"""The router's truthful errors and its operator surface, over real loopback sockets.

Every error case also asserts its cost: a request the router refuses never reaches a
worker, so the fake workers' dispatch counters stay where they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import Status
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.raw_upstream import Exchange, Respond, open_raw_upstream
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def _dispatches(fleet: list[FakeWorkerHandle]) -> list[int]:
    return [handle.worker.routing.dispatches for handle in fleet]


def _chat(model: str) -> dict[str, object]:
    return {**CHAT, "model": model}


@asynccontextmanager
async def _two_model_fleet(
    **router_settings: object,
) -> AsyncIterator[tuple[list[FakeWorkerHandle], str]]:
    """Two workers of model-a that are still loading (their /health answers 503) and one
    healthy worker of model-b; the router asks each worker for its model."""
    loading = FakeWorkerSettings(model="model-a", startup_delay_s=600)
    ready = FakeWorkerSettings(model="model-b")
    async with (
        open_fake_fleet([loading, loading, ready]) as fleet,
        open_router([handle.url for handle in fleet], **router_settings) as router,
    ):
        yield fleet, router.url


async def test_unknown_model_is_404_with_a_healthy_fleet() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(2) as fleet, open_router([w.url for w in fleet]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.post("/v1/chat/completions", json=_chat("no-such-model"))
                served = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert "no-such-model" in response.json()["error"]["message"]
    assert "retry-after" not in response.headers
    assert served.status_code == 200
    assert sum(_dispatches(fleet)) == 1


async def test_every_worker_of_a_model_unhealthy_is_503_naming_unhealthy() -> None:
    with trio.fail_after(20):
        # Threshold 1: the first round of checks, done before the router reports ready,
        # already decides.
        async with _two_model_fleet(health_failure_threshold=1) as (fleet, url):
            async with httpx.AsyncClient(base_url=url) as client:
                blocked = await client.post("/v1/chat/completions", json=_chat("model-a"))
                healthy = await client.post("/v1/chat/completions", json=_chat("model-b"))
                unknown = await client.post("/v1/chat/completions", json=_chat("model-c"))
    assert blocked.status_code == 503
    assert blocked.headers["retry-after"] == "1"
    error = blocked.json()["error"]
    assert error["code"] == "no_available_workers"
    assert error["message"] == "all 2 workers for model 'model-a' are unavailable (2 unhealthy)"
    # The healthy second model neither changes model-a's verdict nor fails itself.
    assert healthy.status_code == 200
    assert healthy.headers["x-router-worker"] == fleet[2].url
    assert unknown.status_code == 404
    assert _dispatches(fleet) == [0, 0, 1]


async def test_health_checks_take_a_worker_out_and_bring_it_back() -> None:
    with trio.fail_after(20):
        async with (
            open_fake_fleet(1) as fleet,
            open_router(
                [fleet[0].url], health_interval_s=0.05, health_failure_threshold=2
            ) as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            worker = router.fleet.workers()[0]
            fleet[0].worker.behaviour.healthy = False
            await wait_until(lambda: not worker.healthy)
            down = await client.post("/v1/chat/completions", json=CHAT)
            not_ready = await client.get("/readiness")
            fleet[0].worker.behaviour.healthy = True
            await wait_until(lambda: worker.healthy)
            up = await client.post("/v1/chat/completions", json=CHAT)
            ready = await client.get("/readiness")
    assert down.status_code == 503
    assert "(1 unhealthy)" in down.json()["error"]["message"]
    assert (not_ready.status_code, not_ready.json()) == (503, {"ready": False})
    assert up.status_code == 200
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    assert fleet[0].worker.routing.dispatches == 1
    # The health checker never writes the status a worker registers itself.
    assert worker.record.status.value == "ACTIVE"


async def test_readiness_health_and_models_with_an_unhealthy_model() -> None:
    with trio.fail_after(20):
        async with _two_model_fleet(health_failure_threshold=1) as (fleet, url):
            async with httpx.AsyncClient(base_url=url) as client:
                readiness = await client.get("/readiness")
                health = await client.get("/health")
                models = await client.get("/v1/models")
    # One model can take work, so the router as a whole is ready.
    assert readiness.status_code == 200
    assert health.status_code == 200
    summary = health.json()
    assert {
        key: summary[key] for key in ("status", "workers", "available", "unhealthy", "draining")
    } == {
        "status": "ok",
        "workers": 3,
        "available": 1,
        "unhealthy": 2,
        "draining": 0,
    }
    assert summary["models"] == ["model-a", "model-b"]
    assert summary["discovery"]["source"] == "static"
    assert models.status_code == 200
    assert [entry["id"] for entry in models.json()["data"]] == ["model-a", "model-b"]
    assert models.json()["object"] == "list"
    assert _dispatches(fleet) == [0, 0, 0]


async def test_readiness_is_503_while_no_worker_can_take_work() -> None:
    with trio.fail_after(20):
        loading = FakeWorkerSettings(startup_delay_s=600)
        async with (
            open_fake_fleet([loading]) as fleet,
            open_router([fleet[0].url], health_failure_threshold=1) as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            readiness = await client.get("/readiness")
            health = await client.get("/health")
    assert (readiness.status_code, readiness.json()) == (503, {"ready": False})
    # Liveness stays 200: the router itself is fine, its fleet is not.
    assert health.status_code == 200
    assert health.json()["available"] == 0
    assert fleet[0].worker.routing.dispatches == 0


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/generate", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("DELETE", "/v1/workers", "GET, HEAD"),
    ],
)
async def test_wrong_method_is_405_with_allow(method: str, path: str, allowed: str) -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(1) as fleet, open_router([fleet[0].url]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.request(method, path, json=CHAT)
    assert response.status_code == 405
    assert response.headers["allow"] == allowed
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert fleet[0].worker.routing.dispatches == 0


async def test_unknown_path_is_404_not_found() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(1) as fleet, open_router([fleet[0].url]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.post("/v1/no-such-route", json=CHAT)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert fleet[0].worker.routing.dispatches == 0


async def test_head_of_a_get_route_has_no_body() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(1) as fleet, open_router([fleet[0].url]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                head = await client.head("/health")
                after = await client.get("/readiness")
    assert head.status_code == 200
    assert head.content == b""
    # The connection stayed in step: the next answer on it is whole.
    assert after.status_code == 200 and after.json() == {"ready": True}
    assert fleet[0].worker.routing.dispatches == 0


async def test_body_over_max_body_bytes_is_413_and_never_dispatched() -> None:
    padding = "x" * 2048
    with trio.fail_after(20):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([fleet[0].url], max_body_bytes=1024) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                declared = await client.post("/v1/chat/completions", json={**CHAT, "user": padding})

                async def chunked() -> AsyncIterator[bytes]:
                    for _ in range(4):
                        yield padding.encode()

                streamed = await client.post("/v1/chat/completions", content=chunked())
                small = await client.post("/v1/chat/completions", json=CHAT)
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        assert "1024 bytes" in response.json()["error"]["message"]
    assert small.status_code == 200
    assert fleet[0].worker.routing.dispatches == 1


async def test_v1_workers_lists_every_field_an_operator_needs() -> None:
    slow = FakeWorkerSettings(tokens=100, token_latency_ms=20)
    with trio.fail_after(20):
        async with (
            open_fake_fleet([slow, slow]) as fleet,
            open_router([f"{fleet[0].url},model=fake-model", fleet[1].url]) as router,
            httpx.AsyncClient(base_url=router.url, timeout=10) as client,
        ):
            async with client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 100}
            ) as stream:
                assert stream.status_code == 200
                busy = stream.headers["x-router-worker"]
                listing = (await client.get("/v1/workers")).json()["workers"]
    assert {entry["id"] for entry in listing} == {fleet[0].url, fleet[1].url}
    for entry in listing:
        assert entry["url"] == entry["id"]
        assert entry["model"] == ["fake-model"]
        assert entry["role"] == "mixed"
        assert entry["status"] == "ACTIVE"
        assert entry["healthy"] is True
        assert entry["inflight"] == (1 if entry["id"] == busy else 0)
        assert entry["breaker"]["state"] == "closed"
    assert sum(_dispatches(fleet)) == 1


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_metrics_count_requests_by_model_route_status() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(2) as fleet, open_router([w.url for w in fleet]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                for _ in range(3):
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                completion = {
                    "model": "fake-model",
                    "prompt": "hi",
                    "max_tokens": 2,
                    "stream": True,
                }
                assert (await client.post("/v1/completions", json=completion)).status_code == 200
                assert (
                    await client.post("/v1/chat/completions", json=_chat("nope"))
                ).status_code == 404
                assert (await client.post("/generate", content=b"{")).status_code == 400
                scrape = await client.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(scrape.text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("router_requests_total", model="fake-model", route="chat", status="200") == 3
    assert (
        value("router_requests_total", model="fake-model", route="completions", status="200") == 1
    )
    # A model nobody serves is not a label value: clients could grow the series without bound.
    assert value("router_requests_total", model="-", route="chat", status="404") == 1
    assert value("router_requests_total", model="-", route="generate", status="400") == 1
    assert value("router_request_duration_seconds_count", route="chat") == 4
    assert value("router_time_to_first_byte_seconds_count", route="chat") == 3
    assert value("router_time_to_first_byte_seconds_count", route="completions") == 1
    assert value("router_workers", model="fake-model", role="mixed", status="ACTIVE") == 2
    for handle in fleet:
        assert value("router_worker_inflight", worker=handle.url) == 0
    assert sum(_dispatches(fleet)) == 4


def _recording_upstream(seen: list[Exchange]) -> Respond:
    async def respond(exchange: Exchange) -> None:
        if exchange.request.target != b"/v1/chat/completions":
            await exchange.respond(200, [(b"content-type", b"application/json")], b"{}")
            return
        seen.append(exchange)
        body = orjson.dumps({"id": "x", "object": "chat.completion", "choices": []})
        await exchange.respond(
            200,
            [
                (b"content-type", b"application/json"),
                (b"x-request-id", b"req-7"),
                (b"x-internal-detail", b"worker secret"),
            ],
            body,
        )

    return respond


async def test_forwarded_headers_and_body_bytes_reach_the_worker() -> None:
    seen: list[Exchange] = []
    # Unusual spacing and key order: the worker must get these exact bytes, not a re-encoding.
    body = b'{ "messages" : [{"role":"user","content":"hi"}],   "model":"m" }'
    with trio.fail_after(20):
        async with (
            open_raw_upstream(_recording_upstream(seen)) as upstream,
            open_router([f"{upstream.url},model=m"]) as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            response = await client.post(
                "/v1/chat/completions",
                content=body,
                headers={
                    "content-type": "application/json",
                    "authorization": "Bearer sk-test",
                    "x-request-id": "req-7",
                    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                    "cookie": "session=secret",
                    "x-session-id": "s-1",
                },
            )
    assert response.status_code == 200
    assert response.headers["x-router-worker"] == upstream.url
    assert response.headers["x-request-id"] == "req-7"
    assert "x-internal-detail" not in response.headers
    assert len(seen) == 1
    forwarded = seen[0]
    assert forwarded.body == body
    assert forwarded.header(b"authorization") == b"Bearer sk-test"
    assert forwarded.header(b"x-request-id") == b"req-7"
    assert (
        forwarded.header(b"traceparent")
        == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    )
    assert forwarded.header(b"content-type") == b"application/json"
    assert forwarded.header(b"host") == upstream.url.removeprefix("http://").encode()
    assert forwarded.header(b"cookie") is None
    assert forwarded.header(b"x-session-id") is None


async def test_stream_answers_carry_x_router_worker() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(2) as fleet, open_router([w.url for w in fleet]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                workers = []
                for _ in range(2):
                    async with client.stream(
                        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
                    ) as stream:
                        assert stream.headers["content-type"] == "text/event-stream"
                        workers.append(stream.headers["x-router-worker"])
                        text = (await stream.aread()).decode()
                    assert text.endswith("data: [DONE]\n\n")
    assert sorted(workers) == sorted(handle.url for handle in fleet)
    assert _dispatches(fleet) == [1, 1]


async def test_503_names_draining_and_unhealthy_together() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(2) as fleet, open_router([w.url for w in fleet]) as router:
            first, second = router.fleet.workers()
            # What a worker's own registration would announce before it goes away.
            router.fleet.upsert(dataclasses.replace(first.record, status=Status.DRAINING))
            second.healthy = False
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.post("/v1/chat/completions", json=CHAT)
                listing = (await client.get("/v1/workers")).json()["workers"]
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"] == (
        "all 2 workers for model 'fake-model' are unavailable (1 draining, 1 unhealthy)"
    )
    # A draining worker stays listed, with its status, so a rollout is visible.
    assert sorted(entry["status"] for entry in listing) == ["ACTIVE", "DRAINING"]
    assert _dispatches(fleet) == [0, 0]


async def test_a_worker_with_a_malformed_model_list_costs_only_itself() -> None:
    asked: list[bytes] = []

    async def not_a_model_list(exchange: Exchange) -> None:
        asked.append(exchange.request.target)
        await exchange.respond(200, [(b"content-type", b"application/json")], b'["fake-model"]')

    with trio.fail_after(20):
        async with (
            open_fake_fleet(1) as fleet,
            open_raw_upstream(not_a_model_list) as odd,
            open_router([fleet[0].url, odd.url]) as router,
            httpx.AsyncClient(base_url=router.url) as client,
        ):
            response = await client.post("/v1/chat/completions", json=CHAT)
            health = (await client.get("/health")).json()
    # The odd worker stays out of the fleet until it names its model; the router serves on.
    assert response.status_code == 200
    assert response.headers["x-router-worker"] == fleet[0].url
    assert health["workers"] == 1
    assert fleet[0].worker.routing.dispatches == 1
    # Asked for its models (again every few seconds), never sent a generation request.
    assert asked and set(asked) == {b"/v1/models"}

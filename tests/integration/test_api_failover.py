"""Failover, the breaker and the 404-versus-503 verdicts on the routes beyond chat, over real
loopback sockets: fake workers, the router.

As for chat (tests/integration/test_failover_breaker.py), the assertions are on the cost:
how many requests reached the broken worker, by its own dispatch counter.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
import trio

from router.fake_worker.behaviour import FailMode
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.breaker import BreakerState
from tests.support.failover import (
    MODEL,
    NO_PROBE,
    breaker_of,
    dispatches,
    fleet_behind_router,
    retries,
    scrape,
    spec,
)
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

GUARD_S = 20
EMBEDDINGS = ("/v1/embeddings", {"model": MODEL, "input": ["hello there"]})
MESSAGES = (
    "/v1/messages",
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]},
)
MESSAGES_STREAM = ("/v1/messages", {**MESSAGES[1], "stream": True})
RESPONSES_STREAM = (
    "/v1/responses",
    {"model": MODEL, "input": "hello", "max_output_tokens": 4, "stream": True},
)
ALWAYS_503 = FakeWorkerSettings(fail_first=-1, fail_status=503)
ROUTES = {"embeddings": EMBEDDINGS, "messages": MESSAGES, "messages-stream": MESSAGES_STREAM}


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    response = await client.post(path, json=body)
    await response.aread()
    return response


def assert_whole_answer(path: str, body: dict[str, Any], response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.text.rstrip().endswith('data: {"type":"message_stop"}')
    elif path == "/v1/embeddings":
        assert len(response.json()["data"][0]["embedding"]) == 16
    else:
        assert response.json()["content"][0]["text"] == expected_text(4)


@pytest.mark.parametrize("route", list(ROUTES))
async def test_breaker_stops_paying_for_a_503_worker_after_three(route: str) -> None:
    path, body = ROUTES[route]
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503, FakeWorkerSettings()],
            breaker_failure_threshold=3,
            client_timeout_s=10,
            **NO_PROBE,
        ) as (fleet, router, client):
            bad, good = fleet
            for _ in range(10):
                response = await post(client, path, body)
                assert_whole_answer(path, body, response)
                assert response.headers["x-router-worker"] == good.url
            retried = await retries(client)
            requests = await scrape(client, "router_requests_total")
            stats = breaker_of(router, bad.url)
    assert (dispatches(bad), dispatches(good)) == (3, 10)
    assert (stats.state, stats.trips) == (BreakerState.OPEN, 1)
    assert retried == {"status_503": 3}
    label = "messages" if path == "/v1/messages" else "embeddings"
    assert requests == {(("model", MODEL), ("route", label), ("status", "200")): 10}


@pytest.mark.parametrize("route", list(ROUTES))
async def test_without_a_breaker_the_503_worker_keeps_being_tried(route: str) -> None:
    path, body = ROUTES[route]
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503, FakeWorkerSettings()],
            breaker_failure_threshold=0,
            client_timeout_s=10,
            **NO_PROBE,
        ) as (fleet, _, client):
            for _ in range(10):
                assert_whole_answer(path, body, await post(client, path, body))
    assert dispatches(fleet[0]) >= 5
    assert dispatches(fleet[1]) == 10


async def test_a_404_for_a_route_the_worker_lacks_is_verbatim_never_retried_never_a_fault() -> None:
    lacks_embeddings = FakeWorkerSettings(fail_first=-1, fail_status=404)
    path, body = EMBEDDINGS
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [lacks_embeddings, FakeWorkerSettings()],
            breaker_failure_threshold=1,
            client_timeout_s=10,
            **NO_PROBE,
        ) as (fleet, router, client):
            lacking, serving = fleet
            async with httpx.AsyncClient(base_url=lacking.url) as direct:
                expected = await direct.post(path, json=body)
            lacking.worker.routing.reset()
            statuses = []
            for _ in range(10):
                response = await post(client, path, body)
                statuses.append(response.status_code)
                if response.status_code == 404:
                    assert response.content == expected.content
                    assert response.headers["x-router-worker"] == lacking.url
            retried = await retries(client)
            stats = breaker_of(router, lacking.url)
    assert expected.status_code == 404
    assert statuses == [404, 200] * 5
    assert (dispatches(lacking), dispatches(serving)) == (5, 5)  # nothing sent twice
    assert retried == {}
    assert (stats.state, stats.consecutive_faults, stats.trips) == (BreakerState.CLOSED, 0, 0)


async def test_unknown_model_is_404_and_a_downed_fleet_503_on_every_new_route() -> None:
    bodies = {
        "/v1/embeddings": {"input": "x"},
        "/v1/rerank": {"query": "q", "documents": ["a"]},
        "/v1/score": {"query": "q", "items": ["a"], "label_token_ids": [1, 2]},
        "/v1/classify": {"input": "x"},
        "/v1/tokenize": {"prompt": "x"},
        "/v1/detokenize": {"tokens": [1]},
        "/tokenize": {"prompt": "x"},
        "/detokenize": {"tokens": [1]},
        "/pooling": {"input": "x"},
        "/v1/responses": {"input": "x"},
        "/v1/messages": MESSAGES[1],
    }
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(1, client_timeout_s=10) as (fleet, router, client):
            served = {
                path: (await post(client, path, {**body, "model": MODEL})).status_code
                for path, body in bodies.items()
            }
            unknown = {
                path: await post(client, path, {**body, "model": "nope"})
                for path, body in bodies.items()
            }
            router.fleet.workers()[0].healthy = False
            down = {
                path: await post(client, path, {**body, "model": MODEL})
                for path, body in bodies.items()
            }
    assert served == dict.fromkeys(bodies, 200)
    assert dispatches(fleet[0]) == len(bodies)  # the 404s and 503s reached nobody
    for path in bodies:
        assert unknown[path].status_code == 404
        assert down[path].status_code == 503
        assert down[path].headers["retry-after"] == "1"
        assert unknown[path].json()["error"]["code"] == "model_not_found"
        assert down[path].json()["error"]["code"] == "no_available_workers"
    assert unknown["/v1/messages"].json()["type"] == "error"
    assert unknown["/v1/messages"].json()["error"]["type"] == "not_found_error"
    assert down["/v1/messages"].json()["error"]["type"] == "overloaded_error"


def _pd_spec(handle: FakeWorkerHandle) -> str:
    settings = handle.settings
    if settings.role == "prefill":
        return f"{handle.url},model={MODEL},role=prefill,bootstrap_port={settings.bootstrap_port}"
    return f"{handle.url},model={MODEL},role={settings.role}"


async def test_non_generation_routes_go_to_the_mixed_worker_and_never_to_pd_workers() -> None:
    fleet_settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9301),
        FakeWorkerSettings(role="decode"),
        FakeWorkerSettings(),
    ]
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(fleet_settings) as fleet,
            open_router([_pd_spec(w) for w in fleet]) as router,
        ):
            prefill, decode, mixed = fleet
            async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
                for _ in range(4):
                    assert (await post(client, *EMBEDDINGS)).status_code == 200
                assert [dispatches(w) for w in fleet] == [0, 0, 4]
                # generation still goes to the pair
                assert (await post(client, *MESSAGES)).status_code == 200
                assert [dispatches(w) for w in fleet] == [1, 1, 4]
                handoff = decode.worker.routing.handoffs[-1]
                assert handoff["path"] == "/v1/messages" and handoff["bootstrap_port"] == 9301

                # the mixed worker gone: PD workers serve generation only
                router.fleet.remove(mixed.url)
                refused = await post(client, *EMBEDDINGS)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_available_workers"
    assert refused.json()["error"]["message"] == (
        f"model '{MODEL}' is served only by prefill/decode workers (2 workers), "
        "and PD workers serve generation only: this route needs a mixed worker"
    )
    assert [dispatches(w) for w in (prefill, decode, mixed)] == [1, 1, 4]


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = orjson.loads(line[len("data: ") :])
        events.append((name, data))
    return events


@pytest.mark.parametrize("route", ["messages", "responses"])
async def test_a_broken_stream_ends_with_the_apis_own_error_event_and_no_retry(route: str) -> None:
    path, body = MESSAGES_STREAM if route == "messages" else RESPONSES_STREAM
    k = 4
    breaks = FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=k)
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [breaks, FakeWorkerSettings()],
            breaker_failure_threshold=1,
            client_timeout_s=10,
            **NO_PROBE,
        ) as (fleet, router, client):
            response = await post(client, path, body)
            stats = breaker_of(router, fleet[0].url)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert len(events) == k + 1  # the worker's k events, whole, then the error event
    name, data = events[-1]
    if route == "messages":
        assert [n for n, _ in events[:2]] == ["message_start", "content_block_start"]
        assert name == "error"
        assert data["type"] == "error"
        assert data["error"]["type"] == "api_error"
        assert data["error"]["code"] == "stream_interrupted"
    else:
        assert events[0][0] == "response.created"
        assert name == "response.failed"
        assert data["type"] == "response.failed"
        assert data["response"]["status"] == "failed"
        assert data["response"]["error"]["code"] == "server_error"
    assert (dispatches(fleet[0]), dispatches(fleet[1])) == (1, 0)
    assert stats.state is BreakerState.CLOSED  # after the first byte: not a fault


def _responses_stream_types(base_url: str) -> list[str]:
    with openai.OpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=10
    ) as client:
        stream = client.responses.create(
            model=MODEL, input="hello", max_output_tokens=4, stream=True
        )
        with stream:
            return [event.type for event in stream]


async def test_the_openai_client_sees_a_broken_responses_stream_as_failed() -> None:
    breaks = FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=5)
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([breaks]) as fleet, open_router([spec(fleet[0].url)]) as router:
            types = await trio.to_thread.run_sync(_responses_stream_types, router.url)
    assert types[0] == "response.created"
    assert types[-1] == "response.failed"
    assert types.count("response.output_text.delta") == 1


async def test_wrong_method_on_messages_is_an_anthropic_405() -> None:
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(1) as (fleet, _, client):
            response = await client.get("/v1/messages")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": "/v1/messages accepts POST, not GET",
        "code": "method_not_allowed",
    }
    assert dispatches(fleet[0]) == 0

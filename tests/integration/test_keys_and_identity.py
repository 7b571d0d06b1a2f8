"""Client keys, worker credentials and request ids over real loopback sockets.

The fake workers record the headers of every generation request they get, so these tests
read what a worker really received: never the client's key, always the router's worker
key, and the request's id on every leg.
"""

from __future__ import annotations

import logging
import os
import signal
from functools import partial
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from router.cli.serve import RunningRouter
from router.discovery.etcd_client import open_etcd_client
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import WorkerRecord
from router.http.server.loop import serve_http
from router.http.server.messages import Request, ResponseWriter
from tests.support.etcd_server import EtcdServer
from tests.support.failover import scrape
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.ports import free_port
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

GUARD_S = 20
MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
CLIENT_KEY = "client-secret-0123"
WORKER_KEY = "worker-secret-4567"
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


def spec(handle: FakeWorkerHandle) -> str:
    return f"{handle.url},model={MODEL}"


def seen_headers(handle: FakeWorkerHandle) -> list[dict[str, str]]:
    return list(handle.worker.routing.headers)


def authorizations(handle: FakeWorkerHandle) -> list[str | None]:
    """The authorization header of each generation request the worker got."""
    return [headers.get("authorization") for headers in seen_headers(handle)]


async def chat_then_listing(router: RunningRouter) -> str:
    """A chat request with the client key (answered 200), then `/v1/workers` as text."""
    async with httpx.AsyncClient(base_url=router.url) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert response.status_code == 200
        return (await client.get("/v1/workers", headers=AUTH)).text


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-key",
        "Basic Y2xpZW50LXNlY3JldC0wMTIz",
        CLIENT_KEY,
        "Bearer",
        f"Bearer {CLIENT_KEY}x",
    ],
)
async def test_a_request_without_the_right_key_is_401_and_reaches_no_worker(
    authorization: str | None,
) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1) as fleet,
            # The router's own reading of the engine's model list (its adapters) is off:
            # every /v1/models the worker sees would be the client's.
            open_router([spec(fleet[0])], api_key=CLIENT_KEY, adapter_list_interval_s=0) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
                    response = await client.post(path, json=CHAT, headers=headers)
                    assert response.status_code == 401, path
                    assert response.json()["error"]["code"] == "invalid_api_key"
                    assert response.headers["www-authenticate"].startswith("Bearer")
                    assert response.headers["x-request-id"]
                models = await client.get("/v1/models", headers=headers)
                assert models.status_code == 401
                workers = await client.get("/v1/workers", headers=headers)
                assert workers.status_code == 401
                # Probes and scrapes stay open.
                for path in ("/health", "/readiness", "/metrics"):
                    assert (await client.get(path)).status_code == 200, path
                refused = await scrape(client, "router_requests_total")
            assert fleet[0].worker.routing.dispatches == 0
            assert fleet[0].worker.routing.paths.get("/v1/models", 0) == 0
            assert refused[(("model", "-"), ("route", "chat"), ("status", "401"))] == 1


async def test_the_right_key_passes_and_the_worker_gets_the_worker_key_not_the_clients() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(2) as fleet,
            open_router(
                [spec(fleet[0]), spec(fleet[1])], api_key=CLIENT_KEY, worker_api_key=WORKER_KEY
            ) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                for _ in range(4):
                    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
                    assert response.status_code == 200
                stream = await client.post(
                    "/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH
                )
                assert stream.status_code == 200
                assert (await client.get("/v1/models", headers=AUTH)).status_code == 200
    received = seen_headers(fleet[0]) + seen_headers(fleet[1])
    assert len(received) == 5
    assert {headers.get("authorization") for headers in received} == {f"Bearer {WORKER_KEY}"}
    assert all(CLIENT_KEY not in value for headers in received for value in headers.values())


async def test_without_client_keys_the_clients_header_passes_through() -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1) as fleet, open_router([spec(fleet[0])]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.post(
                    "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer theirs"}
                )
                assert response.status_code == 200
    assert authorizations(fleet[0]) == ["Bearer theirs"]


async def test_with_client_keys_and_no_worker_key_the_worker_gets_no_authorization() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([spec(fleet[0])], api_key=CLIENT_KEY) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.post(
                    "/v1/chat/completions",
                    json=CHAT,
                    headers=AUTH,
                )
                assert response.status_code == 200
    assert authorizations(fleet[0]) == [None]


async def test_a_worker_records_own_key_wins_over_the_global_worker_key() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([], api_key=CLIENT_KEY, worker_api_key=WORKER_KEY) as router,
        ):
            router.fleet.upsert(
                WorkerRecord.from_json(
                    {"url": fleet[0].url, "model": MODEL, "api_key": "only-for-this-one"}
                )
            )
            listing = await chat_then_listing(router)
    assert authorizations(fleet[0]) == ["Bearer only-for-this-one"]
    assert "only-for-this-one" not in listing


async def test_protect_metrics_closes_metrics_but_not_the_probes() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([spec(fleet[0])], api_key=CLIENT_KEY, protect_metrics=True) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                assert (await client.get("/metrics")).status_code == 401
                assert (await client.get("/metrics", headers=AUTH)).status_code == 200
                assert (await client.get("/health")).status_code == 200
                assert (await client.get("/readiness")).status_code == 200


async def test_named_keys_label_requests_and_sighup_reloads_them(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("alice: key-of-alice\nbob: key-of-bob\n")
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([spec(fleet[0])], api_keys_file=str(keys_file)) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                for key in ("key-of-alice", "key-of-bob", "key-of-bob", "invented"):
                    await client.post(
                        "/v1/chat/completions",
                        json=CHAT,
                        headers={"authorization": f"Bearer {key}"},
                    )
                counts = await scrape(client, "router_requests_total")
                assert counts == {
                    (("key", "alice"), ("model", MODEL), ("route", "chat"), ("status", "200")): 1,
                    (("key", "bob"), ("model", MODEL), ("route", "chat"), ("status", "200")): 2,
                    (("key", "-"), ("model", "-"), ("route", "chat"), ("status", "401")): 1,
                }
                keys_file.write_text("carol: key-of-carol\n")
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_until(lambda: router.app.keys.names() == ["carol"])
                carol = await client.post(
                    "/v1/chat/completions",
                    json=CHAT,
                    headers={"authorization": "Bearer key-of-carol"},
                )
                alice = await client.post(
                    "/v1/chat/completions",
                    json=CHAT,
                    headers={"authorization": "Bearer key-of-alice"},
                )
                assert (carol.status_code, alice.status_code) == (200, 401)
    assert fleet[0].worker.routing.dispatches == 4


async def test_a_client_request_id_reaches_every_leg_the_answer_and_the_trip_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router")
    bootstrap = free_port()
    prefill = FakeWorkerSettings(role="prefill", bootstrap_port=bootstrap)
    decode = FakeWorkerSettings(role="decode")
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([prefill, decode]) as fleet:
            specs = [
                f"{fleet[0].url},role=prefill,bootstrap_port={bootstrap}",
                f"{fleet[1].url},role=decode",
            ]
            async with open_router(specs, breaker_failure_threshold=1) as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    response = await client.post(
                        "/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-abc-1"}
                    )
                    assert response.status_code == 200
                    assert response.headers.get_list("x-request-id") == ["req-abc-1"]
                    # No id given: one is made and sent to both legs.
                    made = await client.post("/v1/chat/completions", json=CHAT)
                    made_id = made.headers["x-request-id"]
                    assert len(made_id) == 32
                    # The decode now fails: its breaker trips on the request that broke it.
                    await client.post(
                        f"{fleet[1].url}/debug/behaviour",
                        json={"fail_first": 1, "fail_status": 500},
                    )
                    failed = await client.post(
                        "/v1/chat/completions",
                        json=CHAT,
                        headers={"x-correlation-id": "corr-trip-7"},
                    )
                    assert failed.headers["x-request-id"] == "corr-trip-7"
    for handle in fleet:
        ids = [headers.get("x-request-id") for headers in seen_headers(handle)]
        assert ids == ["req-abc-1", made_id, "corr-trip-7"], handle.settings.role
    messages = [record.getMessage() for record in caplog.records]
    assert any(
        "breaker of" in m and "opened" in m and "[request corr-trip-7]" in m for m in messages
    ), messages
    assert any("attempt on" in m and "[request corr-trip-7]" in m for m in messages), messages


async def test_an_etcd_record_carries_its_workers_key_and_the_listing_hides_it(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1) as fleet, open_etcd_client(etcd.url) as etcd_client:
            record = {
                "id": "keyed",
                "url": fleet[0].url,
                "model": MODEL,
                "api_key": "from-the-record",
            }
            await etcd_client.put("/keys-test/keyed", orjson.dumps(record))
            async with open_router(
                discovery="etcd",
                etcd_endpoint=etcd.url,
                etcd_prefix="/keys-test/",
                api_key=CLIENT_KEY,
                worker_api_key=WORKER_KEY,
            ) as router:
                await wait_until(lambda: router.fleet.get("keyed") is not None)
                listing = await chat_then_listing(router)
    assert authorizations(fleet[0]) == ["Bearer from-the-record"]
    assert "from-the-record" not in listing and "keyed" in listing


async def test_a_worker_that_guards_its_models_list_is_asked_with_the_worker_key() -> None:
    asked_with: list[bytes | None] = []

    async def keyed_worker(request: Request, writer: ResponseWriter) -> None:
        authorization = request.header(b"authorization")
        if request.path == "/health":
            await writer.respond(200, [], b"")
            return
        asked_with.append(authorization)
        if authorization != f"Bearer {WORKER_KEY}".encode():
            await writer.respond(
                401, [(b"content-type", b"application/json")], b'{"error": "no key"}'
            )
            return
        if request.path == "/v1/models":
            await writer.respond(
                200, [(b"content-type", b"application/json")], b'{"data": [{"id": "guarded"}]}'
            )
            return
        await writer.respond(200, [(b"content-type", b"application/json")], b'{"choices": []}')

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, keyed_worker))
            async with open_router(
                [f"http://127.0.0.1:{port}"], api_key=CLIENT_KEY, worker_api_key=WORKER_KEY
            ) as router:
                assert router.fleet.models() == ["guarded"]
                # the engine's kind is asked too (its server info), with the same key
                await wait_until(lambda: not router.fleet.describing)
                async with httpx.AsyncClient(base_url=router.url) as client:
                    response = await client.post(
                        "/v1/chat/completions",
                        json={**CHAT, "model": "guarded"},
                        headers=AUTH,
                    )
                    assert response.status_code == 200
            nursery.cancel_scope.cancel()
    # Its models, its server info and the chat; and the adapter list reader's reading of
    # its models, when it came before the end: every one with the worker key.
    assert asked_with == [f"Bearer {WORKER_KEY}".encode()] * len(asked_with)
    assert 3 <= len(asked_with) <= 4

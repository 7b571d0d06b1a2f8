"""Prefill/decode pairing and DP rank routing over real loopback sockets.

Every check reads what the fake workers themselves received (`routing.handoffs`, the
rank header counts, dispatch and disconnect counters), so a test sees the handoff the
engines would act on, not the router's intention.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import httpx
import orjson
import pytest
import trio

from router.cli.serve import RunningRouter
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import Status, WorkerRecord
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.http_client import RawClient
from tests.support.router_instance import open_router
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

MODEL = "fake-model"
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
# No max_tokens in the requests: each worker generates its own default, so the client's
# text tells which leg it came from.
PREFILL_TOKENS = 2
DECODE_TOKENS = 5
DECODE_TEXT = expected_text(DECODE_TOKENS)
LONG_COOLDOWN = {"breaker_cooldown_s": 600.0, "breaker_max_cooldown_s": 600.0}


def prefill(bootstrap_port: int, **changes: Any) -> FakeWorkerSettings:
    return FakeWorkerSettings(
        role="prefill", tokens=PREFILL_TOKENS, bootstrap_port=bootstrap_port, **changes
    )


def decode(**changes: Any) -> FakeWorkerSettings:
    return FakeWorkerSettings(role="decode", tokens=DECODE_TOKENS, **changes)


def spec(handle: FakeWorkerHandle) -> str:
    """The `--worker` flag that describes `handle` as it is."""
    settings = handle.settings
    parts = [handle.url, f"role={settings.role}"]
    if settings.role == "prefill":
        parts.append(f"bootstrap_port={settings.bootstrap_port}")
    if settings.dp_size > 1:
        parts.append(f"dp_size={settings.dp_size}")
    return ",".join(parts)


def rooms_of(handle: FakeWorkerHandle) -> dict[int, dict[str, Any]]:
    """The handoffs a worker received, by room (scalar handoffs only)."""
    return {record["bootstrap_room"]: record for record in handle.worker.routing.handoffs}


async def stream_text(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str]:
    """The streamed chat text and the worker the router names."""
    text = []
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        assert response.status_code == 200
        worker = response.headers["x-router-worker"]
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[len("data: ") :])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text), worker


async def settled(router: RunningRouter) -> None:
    """Wait until the router let go of every worker.

    The client can hold the decode's answer before the prefill leg has ended (and before
    a fake has counted it), so counts are read only once nothing is in flight.
    """
    with trio.fail_after(2):
        await wait_until(lambda: all(w.inflight == 0 for w in router.fleet.workers()))


def both_saw(first: FakeWorkerHandle, second: FakeWorkerHandle, disconnects: int) -> bool:
    return first.worker.routing.disconnects == second.worker.routing.disconnects == disconnects


def sample(router: RunningRouter, name: str, **labels: str) -> float:
    value = router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.parametrize(("prefills", "decodes"), [(1, 1), (2, 2)])
async def test_both_legs_get_one_handoff_and_the_client_gets_the_decode_text(
    prefills: int, decodes: int
) -> None:
    settings = [prefill(9100 + i) for i in range(prefills)] + [decode() for _ in range(decodes)]
    with trio.fail_after(30):
        async with (
            open_fake_fleet(settings) as fleet,
            open_router([spec(h) for h in fleet]) as router,
        ):
            prefill_handles, decode_handles = fleet[:prefills], fleet[prefills:]
            decode_urls = {h.url for h in decode_handles}
            async with httpx.AsyncClient(base_url=router.url) as client:
                for _ in range(4):
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
                    assert response.json()["choices"][0]["message"]["content"] == DECODE_TEXT
                    assert response.headers["x-router-worker"] in decode_urls
                for _ in range(4):
                    text, worker = await stream_text(client, CHAT)
                    assert text == DECODE_TEXT
                    assert worker in decode_urls

            await settled(router)
            assert [h.worker.routing.dispatches for h in prefill_handles] == [
                8 // prefills
            ] * prefills
            assert [h.worker.routing.dispatches for h in decode_handles] == [8 // decodes] * decodes
            prefill_rooms = {
                room: (h, record) for h in prefill_handles for room, record in rooms_of(h).items()
            }
            decode_rooms = {
                room: record for h in decode_handles for room, record in rooms_of(h).items()
            }
            # Eight requests, eight distinct rooms, each seen by exactly one prefill and one decode.
            assert len(prefill_rooms) == len(decode_rooms) == 8
            assert set(prefill_rooms) == set(decode_rooms)
            for room, (handle, record) in prefill_rooms.items():
                assert 0 <= room < 2**63
                advertised = ("127.0.0.1", handle.settings.bootstrap_port)
                assert (record["bootstrap_host"], record["bootstrap_port"]) == advertised
                partner = decode_rooms[room]
                assert (partner["bootstrap_host"], partner["bootstrap_port"]) == advertised
                # Single-rank workers: no rank header, no prefill rank hint.
                assert record["dp_rank_header"] is None
                assert partner["disagg_prefill_dp_rank"] is None
    assert sample(router, "router_pd_requests_total", mode="pd") == 8
    assert sample(router, "router_pd_requests_total", mode="mixed") == 0


async def test_a_dp4_prefill_spreads_ranks_and_rooms_name_the_rank() -> None:
    slow_prefill = prefill(9200, dp_size=4, ttft_ms=500)
    with trio.fail_after(30):
        async with (
            open_fake_fleet([slow_prefill, decode()]) as fleet,
            open_router([spec(h) for h in fleet]) as router,
        ):
            p, d = fleet
            async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
                # Eight at once: each takes the least-loaded rank while the others are in flight.
                burst = Traffic()
                send = functools.partial(client.post, "/v1/chat/completions", json=CHAT)
                await burst.keep_sending(send, clients=8, most=1)
                assert burst.statuses() == [200] * 8
                await settled(router)
                assert p.worker.routing.ranks == {"0": 2, "1": 2, "2": 2, "3": 2}
                assert d.worker.routing.ranks == {}

                p.worker.behaviour.ttft_ms = 0.0
                for _ in range(100):
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
            await settled(router)
            # One after another, equally idle ranks take turns. Not exactly 25 each: a
            # request can arrive while the previous one's prefill lease is still held.
            ranks = p.worker.routing.ranks
            assert sorted(ranks) == ["0", "1", "2", "3"] and sum(ranks.values()) == 108
            assert min(ranks.values()) >= 20
            prefill_rooms = rooms_of(p)
            decode_rooms = rooms_of(d)
            assert len(prefill_rooms) == len(decode_rooms) == 100
            assert set(prefill_rooms) == set(decode_rooms)
            for room, record in prefill_rooms.items():
                rank = int(record["dp_rank_header"])
                assert room % 4 == rank
                assert record["disagg_prefill_dp_rank"] == rank
                assert decode_rooms[room]["disagg_prefill_dp_rank"] == rank
                assert decode_rooms[room]["dp_rank_header"] is None
            router_worker = router.fleet.get(p.url)
            assert router_worker is not None
            assert router_worker.rank_inflight == [0, 0, 0, 0]


async def test_a_batched_completion_gets_one_room_per_prompt() -> None:
    prompts = ["one", "two words", "three more words"]
    with trio.fail_after(30):
        async with (
            open_fake_fleet([prefill(9300, dp_size=4), decode()]) as fleet,
            open_router([spec(h) for h in fleet]) as router,
        ):
            p, d = fleet
            async with httpx.AsyncClient(base_url=router.url) as client:
                for stream in (False, True):
                    body = {"model": MODEL, "prompt": prompts, "stream": stream}
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200
                    assert response.headers["x-router-worker"] == d.url
            await settled(router)
            assert p.worker.routing.dispatches == d.worker.routing.dispatches == 2
            for sent, received in zip(
                p.worker.routing.handoffs, d.worker.routing.handoffs, strict=True
            ):
                rank = int(sent["dp_rank_header"])
                assert sent["bootstrap_room"] == received["bootstrap_room"]
                assert len(set(sent["bootstrap_room"])) == len(prompts)
                assert all(room % 4 == rank for room in sent["bootstrap_room"])
                assert received["bootstrap_host"] == ["127.0.0.1"] * len(prompts)
                assert received["bootstrap_port"] == [9300] * len(prompts)
                assert received["disagg_prefill_dp_rank"] == rank


@pytest.mark.parametrize("bad_role", ["decode", "prefill"])
async def test_a_broken_leg_trips_only_its_own_worker(bad_role: str) -> None:
    # A real decode waits for the prefill's KV, so it answers after the prefill does.
    good_decode = decode(ttft_ms=20)
    broken = {"fail_first": -1, "fail_status": 503}
    # One partner only: every failed attempt's partner must serve the retry too.
    if bad_role == "decode":
        settings = [prefill(9401), decode(**broken), good_decode]
        bad_index, partner_index = 1, 0
    else:
        settings = [prefill(9401, **broken), prefill(9402), good_decode]
        bad_index, partner_index = 0, 2
    with trio.fail_after(30):
        async with (
            open_fake_fleet(settings) as fleet,
            open_router([spec(h) for h in fleet], **LONG_COOLDOWN) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                for _ in range(10):
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
                    assert response.json()["choices"][0]["message"]["content"] == DECODE_TEXT
            await settled(router)
            now = trio.current_time()
            bad = fleet[bad_index]
            assert bad.worker.routing.dispatches == 3
            bad_breaker = router.fleet.get(bad.url).breaker  # type: ignore[union-attr]
            assert bad_breaker is not None and bad_breaker.statistics(now).trips == 1
            assert sample(router, "router_worker_breaker_trips_total", worker=bad.url) == 1
            # The partners of the failed attempts, and every other worker: never blamed.
            for handle in fleet:
                if handle is bad:
                    continue
                breaker = router.fleet.get(handle.url).breaker  # type: ignore[union-attr]
                assert breaker is not None
                stats = breaker.statistics(now)
                assert (stats.trips, stats.consecutive_faults, int(stats.state)) == (0, 0, 0), (
                    handle.settings.role
                )
                assert sample(router, "router_worker_breaker_trips_total", worker=handle.url) == 0
            assert fleet[partner_index].worker.routing.dispatches >= 10
            assert sample(router, "router_leg_failures_total", role=bad_role) == 3
            other_role = "prefill" if bad_role == "decode" else "decode"
            assert sample(router, "router_leg_failures_total", role=other_role) == 0
            # Failover is per attempt; the request counts once.
            assert sample(router, "router_pd_requests_total", mode="pd") == 10
            assert sample(router, "router_retries_total", reason="status_503") == 3


async def test_half_a_pd_fleet_is_503_naming_the_empty_leg_until_a_mixed_worker_serves() -> None:
    settings = [prefill(9501), prefill(9502), decode(), FakeWorkerSettings(tokens=3)]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as fleet:
            p1, p2, d, mixed = fleet
            async with (
                open_router([spec(h) for h in (p1, p2, d)]) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                decode_record = router.fleet.get(d.url)
                assert decode_record is not None

                router.fleet.upsert(
                    dataclasses.replace(decode_record.record, status=Status.DRAINING)
                )
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"] == {
                    "message": f"the only decode worker for model '{MODEL}' is unavailable (1 draining); "
                    "prefill has 2 workers",
                    "type": "service_unavailable",
                    "code": "no_available_workers",
                }

                router.fleet.remove(d.url)
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "no_available_workers"
                assert response.json()["error"]["message"] == (
                    f"decode pool for model '{MODEL}' is empty; prefill has 2 workers"
                )

                # A model nobody serves stays a 404 beside the half fleet.
                response = await client.post(
                    "/v1/chat/completions", json={**CHAT, "model": "absent"}
                )
                assert response.status_code == 404
                assert response.json()["error"]["code"] == "model_not_found"
                assert (
                    response.json()["error"]["message"]
                    == "model 'absent' is not served by any worker"
                )

                # The rolling-upgrade case: a mixed worker for the same model serves at once.
                router.fleet.upsert(WorkerRecord(id=mixed.url, url=mixed.url, models=(MODEL,)))
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200
                assert response.headers["x-router-worker"] == mixed.url
                assert response.json()["choices"][0]["message"]["content"] == expected_text(3)
                await settled(router)
            # One PD request (on either prefill), then the mixed worker; none for the 503s.
            assert [h.worker.routing.dispatches for h in fleet][2:] == [1, 1]
            assert p1.worker.routing.dispatches + p2.worker.routing.dispatches == 1
            assert sample(router, "router_pd_requests_total", mode="pd") == 1
            assert sample(router, "router_pd_requests_total", mode="mixed") == 1


async def test_a_client_leaving_before_the_first_token_closes_both_legs() -> None:
    slow = {"ttft_ms": 10_000.0}
    settings = [prefill(9601, dp_size=2, **slow), decode(dp_size=2, **slow)]
    with trio.fail_after(30):
        async with (
            open_fake_fleet(settings) as fleet,
            open_router([spec(h) for h in fleet]) as router,
        ):
            p, d = fleet
            for stream in (True, False):
                client = await RawClient.connect(router.port)
                body = orjson.dumps({**CHAT, "stream": stream})
                await client.send_request(
                    "POST", "/v1/chat/completions", [("content-type", "application/json")], body
                )
                with trio.fail_after(2):
                    await wait_until(
                        lambda: p.worker.routing.inflight == 1 and d.worker.routing.inflight == 1
                    )
                seen = p.worker.routing.disconnects + 1
                await client.aclose()
                with trio.fail_after(1):
                    await wait_until(functools.partial(both_saw, p, d, seen))
                with trio.fail_after(1):
                    await wait_until(lambda: all(w.inflight == 0 for w in router.fleet.workers()))
                for worker in router.fleet.workers():
                    assert worker.rank_inflight == [0, 0]
                    assert worker.breaker is not None
                    assert worker.breaker.statistics(trio.current_time()).consecutive_faults == 0
                assert p.worker.routing.inflight == d.worker.routing.inflight == 0
            assert p.worker.routing.disconnects == d.worker.routing.disconnects == 2
            assert sample(router, "router_leg_failures_total", role="prefill") == 0
            assert sample(router, "router_leg_failures_total", role="decode") == 0


async def test_a_client_error_both_legs_refuse_is_not_logged_as_a_prefill_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The router passes sampling parameters through; both engines refuse this one.
    bad = {"model": MODEL, "text": "hello", "sampling_params": {"max_new_tokens": -5}}
    with trio.fail_after(30):
        async with (
            open_fake_fleet([prefill(9300), decode()]) as fleet,
            open_router([spec(h) for h in fleet]) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                with caplog.at_level(logging.DEBUG, logger="router.pd"):
                    statuses = [
                        (await client.post("/generate", json=bad)).status_code for _ in range(20)
                    ]
            await settled(router)
    assert statuses == [400] * 20
    # Both legs were sent each request and refused it.
    assert [h.worker.routing.paths.get("/generate") for h in fleet] == [20, 20]
    pd_lines = [r for r in caplog.records if r.name == "router.pd"]
    assert [r for r in pd_lines if r.levelno >= logging.WARNING] == []

"""Failover and the circuit breaker over real loopback sockets: fake workers, the router.

Failover makes almost every request here answer 200 with or without a breaker, so the
assertions are on the cost: how many requests reached the broken worker (its own dispatch
counter, or for a port nobody listens on, the router's retry counter).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import trio

from router.cli.serve import RunningRouter
from router.fake_worker.behaviour import FailMode
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.breaker import BreakerState
from router.fleet.records import Role
from router.policies.consistent_hash import ConsistentHash
from router.policies.policy import PolicyKey
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
from tests.support.ports import free_port, free_ports, unanswered_port
from tests.support.router_instance import open_router

GUARD_S = 20
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
STREAM_CHAT = {**CHAT, "stream": True}
HEALTHY = FakeWorkerSettings()
ALWAYS_503 = FakeWorkerSettings(fail_first=-1, fail_status=503)


@dataclass
class StreamResult:
    status: int
    body: bytes
    worker: str | None

    def data_events(self) -> list[bytes]:
        return [event for event in self.events() if event.startswith(b"data: ")]

    def events(self) -> list[bytes]:
        return [event for event in self.body.split(b"\n\n") if event]


async def post_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamResult:
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        received = b"".join([chunk async for chunk in response.aiter_raw()])
        return StreamResult(response.status_code, received, response.headers.get("x-router-worker"))


# -- the cost of one broken worker ------------------------------------------------------


@dataclass(frozen=True)
class Broken:
    """A way for the first worker of two to be broken, and how a request is sent."""

    name: str
    settings: FakeWorkerSettings | None  # None: a port nobody listens on
    stream: bool = False


BROKEN = [
    Broken("503", ALWAYS_503),
    Broken("503-stream", ALWAYS_503, stream=True),
    Broken("refused", None),
    Broken("reset", FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.RESET)),
    Broken("garbage-200", FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.GARBAGE)),
]


async def send_ten(router: RunningRouter, broken: Broken) -> list[str | None]:
    """Ten sequential requests; every one must be answered 200. Returns who answered."""
    answered_by: list[str | None] = []
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        for _ in range(10):
            if broken.stream:
                result = await post_stream(client, STREAM_CHAT)
                assert result.status == 200
                assert result.events()[-1] == b"data: [DONE]"
                answered_by.append(result.worker)
            else:
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["message"]["content"]
                answered_by.append(response.headers.get("x-router-worker"))
    return answered_by


@asynccontextmanager
async def broken_and_healthy(
    broken: Broken, **overrides: Any
) -> AsyncIterator[tuple[RunningRouter, str, FakeWorkerHandle | None, FakeWorkerHandle]]:
    """A router over [broken, healthy] (in that round-robin order)."""
    port = free_port()  # refused: nothing listens there
    fakes = [HEALTHY] if broken.settings is None else [broken.settings, HEALTHY]
    async with open_fake_fleet(fakes) as fleet:
        bad_url = f"http://127.0.0.1:{port}" if broken.settings is None else fleet[0].url
        bad_handle = None if broken.settings is None else fleet[0]
        good = fleet[-1]
        async with open_router(
            [spec(bad_url), spec(good.url)], **{**NO_PROBE, **overrides}
        ) as router:
            yield router, bad_url, bad_handle, good


async def bad_worker_cost(router: RunningRouter, bad: FakeWorkerHandle | None) -> int:
    """Requests that reached the broken worker.

    Nothing counts refused connects at a port nobody listens on, so for it the router's
    retries count: every failed attempt there was followed by one on the healthy worker.
    """
    if bad is not None:
        return dispatches(bad)
    async with httpx.AsyncClient(base_url=router.url) as client:
        return int((await retries(client)).get("connect_error", 0))


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
async def test_breaker_stops_paying_for_a_broken_worker_after_three(broken: Broken) -> None:
    with trio.fail_after(GUARD_S):
        async with broken_and_healthy(broken, breaker_failure_threshold=3) as (
            router,
            bad_url,
            bad,
            good,
        ):
            answered_by = await send_ten(router, broken)
            cost = await bad_worker_cost(router, bad)
            assert answered_by == [good.url] * 10
            assert cost == 3
            assert dispatches(good) == 10
            stats = breaker_of(router, bad_url)
            async with httpx.AsyncClient(base_url=router.url) as client:
                trips = await scrape(client, "router_worker_breaker_trips_total")
    assert (stats.state, stats.trips) == (BreakerState.OPEN, 1)
    assert trips[(("worker", bad_url),)] == 1
    assert (("worker", good.url),) not in trips or trips[(("worker", good.url),)] == 0


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
async def test_without_a_breaker_the_broken_worker_keeps_being_tried(broken: Broken) -> None:
    with trio.fail_after(GUARD_S):
        async with broken_and_healthy(broken, breaker_failure_threshold=0) as (
            router,
            bad_url,
            bad,
            good,
        ):
            answered_by = await send_ten(router, broken)
            cost = await bad_worker_cost(router, bad)
            worker = router.fleet.get(bad_url)
    assert answered_by == [good.url] * 10
    assert cost >= 5
    assert worker is not None and worker.breaker is None


# -- what is not a fault ----------------------------------------------------------------


async def test_400_is_returned_verbatim_after_one_attempt_and_never_trips() -> None:
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            2, policy="consistent_hash", breaker_failure_threshold=3, breaker_cooldown_s=60.0
        ) as (fleet, router, client):
            session = b"conversation-1"
            target_id = (
                ConsistentHash()
                .pick(PolicyKey(MODEL, Role.MIXED, session), router.fleet.workers())
                .id
            )
            bad, other = (fleet[0], fleet[1]) if fleet[0].url == target_id else (fleet[1], fleet[0])
            bad.worker.behaviour.update({"fail_first": -1, "fail_status": 400})
            async with httpx.AsyncClient(base_url=bad.url) as direct:
                expected = await direct.post("/v1/chat/completions", json=CHAT)
            bad.worker.routing.reset()
            for _ in range(20):
                response = await client.post(
                    "/v1/chat/completions",
                    json=CHAT,
                    headers={"x-session-id": session.decode()},
                )
                assert response.status_code == 400
                assert response.content == expected.content
                assert response.headers["content-type"] == expected.headers["content-type"]
                assert response.headers["x-router-worker"] == bad.url
            retried = await retries(client)
            stats = breaker_of(router, bad.url)
    assert expected.status_code == 400
    assert (dispatches(bad), dispatches(other)) == (20, 0)
    assert retried == {}
    assert (stats.state, stats.consecutive_faults, stats.trips) == (BreakerState.CLOSED, 0, 0)


async def test_429_fails_over_without_a_fault_and_passes_retry_after_through_at_the_end() -> None:
    busy = FakeWorkerSettings(fail_first=-1, fail_status=429)
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [busy, HEALTHY], breaker_failure_threshold=1, **NO_PROBE
        ) as (fleet, router, client):
            for _ in range(4):
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200
                assert response.headers["x-router-worker"] == fleet[1].url
            assert await retries(client) == {"status_429": 4}
            assert (dispatches(fleet[0]), dispatches(fleet[1])) == (4, 4)
            assert breaker_of(router, fleet[0].url).state is BreakerState.CLOSED

            # Both busy: the client gets the last worker's own 429, Retry-After included.
            fleet[1].worker.behaviour.update({"fail_first": -1, "fail_status": 429})
            async with httpx.AsyncClient(base_url=fleet[1].url) as direct:
                expected = await direct.post("/v1/chat/completions", json=CHAT)
            fleet[1].worker.routing.reset()
            response = await client.post("/v1/chat/completions", json=CHAT)
            states = [breaker_of(router, w.url) for w in fleet]
    assert response.status_code == 429
    assert response.headers["retry-after"] == expected.headers["retry-after"] == "1"
    assert response.headers["x-router-worker"] == fleet[1].url
    assert response.content == expected.content
    assert (dispatches(fleet[0]), dispatches(fleet[1])) == (5, 1)
    assert [(s.state, s.consecutive_faults) for s in states] == [(BreakerState.CLOSED, 0)] * 2


# -- after the first byte ---------------------------------------------------------------


async def test_a_stream_broken_after_k_events_ends_with_an_error_event_and_no_retry() -> None:
    k = 3
    breaks = FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=k)
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [breaks, HEALTHY], breaker_failure_threshold=1, **NO_PROBE
        ) as (fleet, router, client):
            result = await post_stream(client, STREAM_CHAT)
            retried = await retries(client)
            stats = breaker_of(router, fleet[0].url)
    events = result.events()
    assert result.status == 200
    assert result.worker == fleet[0].url
    assert len(events) == k + 1
    assert all(event.startswith(b"data: {") for event in events[:k])
    assert events[-1].startswith(b"event: error\ndata: ")
    error = orjson.loads(events[-1].split(b"data: ", 1)[1])
    assert error["error"]["code"] == "stream_interrupted"
    assert (dispatches(fleet[0]), dispatches(fleet[1])) == (1, 0)
    assert retried == {}
    # Threshold 1: had the break counted, the breaker would be open now.
    assert (stats.state, stats.consecutive_faults) == (BreakerState.CLOSED, 0)


async def test_a_stream_that_stalls_mid_way_ends_with_an_idle_timeout_error_event() -> None:
    stalls = FakeWorkerSettings(tokens=4, token_latency_ms=10_000)
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [stalls, HEALTHY], breaker_failure_threshold=1, stream_idle_timeout_s=0.3, **NO_PROBE
        ) as (fleet, router, client):
            started = trio.current_time()
            result = await post_stream(client, STREAM_CHAT)
            took = trio.current_time() - started
            retried = await retries(client)
            stats = breaker_of(router, fleet[0].url)
    events = result.events()
    assert result.status == 200
    assert 0.3 <= took < 5
    assert events[0].startswith(b"data: {")
    assert events[-1].startswith(b"event: error\ndata: ")
    assert orjson.loads(events[-1].split(b"data: ", 1)[1])["error"]["code"] == "stream_idle_timeout"
    assert b"[DONE]" not in result.body
    assert (dispatches(fleet[0]), dispatches(fleet[1])) == (1, 0)
    assert retried == {}
    assert (stats.state, stats.consecutive_faults) == (BreakerState.CLOSED, 0)


# -- timeouts before the first byte -----------------------------------------------------


async def test_first_byte_timeout_fails_over_and_counts_as_a_fault() -> None:
    hangs = FakeWorkerSettings(fail_first=-1, fail_mode=FailMode.HANG)
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [hangs, HEALTHY], breaker_failure_threshold=3, first_byte_timeout_s=0.3, **NO_PROBE
        ) as (fleet, router, client):
            started = trio.current_time()
            response = await client.post("/v1/chat/completions", json=CHAT)
            took = trio.current_time() - started
            retried = await retries(client)
            stats = breaker_of(router, fleet[0].url)
    assert response.status_code == 200
    assert response.headers["x-router-worker"] == fleet[1].url
    assert 0.3 <= took < 5
    assert (dispatches(fleet[0]), dispatches(fleet[1])) == (1, 1)
    assert retried == {"first_byte_timeout": 1}
    assert (stats.state, stats.consecutive_faults) == (BreakerState.CLOSED, 1)


async def test_connect_timeout_gives_up_on_a_silent_port_long_before_the_first_byte_deadline() -> (
    None
):
    with trio.fail_after(GUARD_S):
        async with unanswered_port() as port, open_fake_fleet([HEALTHY]) as fleet:
            silent = f"http://127.0.0.1:{port}"
            async with open_router(
                [spec(silent), spec(fleet[0].url)],
                breaker_failure_threshold=3,
                connect_timeout_s=0.3,
                first_byte_timeout_s=30.0,
                health_timeout_s=0.1,
                **NO_PROBE,
            ) as router:
                async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
                    started = trio.current_time()
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    took = trio.current_time() - started
                    retried = await retries(client)
                stats = breaker_of(router, silent)
    assert response.status_code == 200
    assert response.headers["x-router-worker"] == fleet[0].url
    assert 0.3 <= took < 5
    assert retried == {"connect_timeout": 1}
    assert stats.consecutive_faults == 1


# -- attempts run out -------------------------------------------------------------------


async def test_when_attempts_run_out_the_client_gets_the_last_workers_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    statuses = [500, 502, 503]
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [FakeWorkerSettings(fail_first=-1, fail_status=s) for s in statuses],
            breaker_failure_threshold=3,
            **NO_PROBE,
        ) as (fleet, _, client):
            direct: dict[str, httpx.Response] = {}
            for handle in fleet:
                async with httpx.AsyncClient(base_url=handle.url) as worker_client:
                    direct[handle.url] = await worker_client.post("/v1/chat/completions", json=CHAT)
                handle.worker.routing.reset()
            caplog.clear()
            response = await client.post("/v1/chat/completions", json=CHAT)
            retried = await retries(client)
    # The order the workers were tried in, from the router's one line per failed attempt.
    tried = [r.getMessage().split()[2] for r in caplog.records if r.name == "router.failover"]
    assert sorted(tried) == sorted(w.url for w in fleet)
    last = tried[-1]
    expected = direct[last]
    assert response.headers["x-router-worker"] == last
    assert response.status_code == expected.status_code
    assert response.content == expected.content
    assert response.headers.get("retry-after") == expected.headers.get("retry-after")
    assert [dispatches(w) for w in fleet] == [1, 1, 1]
    # Two failures were followed by another attempt; the last one ended the request.
    assert retried == {f"status_{direct[url].status_code}": 1 for url in tried[:2]}


async def test_three_always_503_workers_pass_the_last_answer_and_retry_after_through() -> None:
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503] * 3, breaker_failure_threshold=3, **NO_PROBE
        ) as (fleet, _, client):
            async with httpx.AsyncClient(base_url=fleet[0].url) as worker_client:
                expected = await worker_client.post("/v1/chat/completions", json=CHAT)
            fleet[0].worker.routing.reset()
            response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.content == expected.content
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == expected.headers["retry-after"] == "1"
    assert [dispatches(w) for w in fleet] == [1, 1, 1]


async def test_when_no_worker_answers_the_client_gets_502_worker_unreachable() -> None:
    with trio.fail_after(GUARD_S):
        urls = [f"http://127.0.0.1:{port}" for port in free_ports(3)]
        async with open_router(
            [spec(url) for url in urls], breaker_failure_threshold=3, **NO_PROBE
        ) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                response = await client.post("/v1/chat/completions", json=CHAT)
                retried = await retries(client)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "worker_unreachable"
    assert all(url in error["message"] for url in urls)
    assert retried == {"connect_error": 2}


# -- every worker open ------------------------------------------------------------------


async def test_all_open_dispatches_anyway_by_default() -> None:
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503, ALWAYS_503], breaker_failure_threshold=1, **NO_PROBE
        ) as (fleet, router, client):
            first = await client.post("/v1/chat/completions", json=CHAT)
            assert [breaker_of(router, w.url).state for w in fleet] == [BreakerState.OPEN] * 2
            # Every worker open: still dispatched, and the worker's own answer comes back.
            second = await client.post("/v1/chat/completions", json=CHAT)
            assert [dispatches(w) for w in fleet] == [2, 2]
            # One recovers while open: forced traffic finds it and closes its breaker.
            fleet[1].worker.behaviour.update({"fail_first": 0})
            third = await client.post("/v1/chat/completions", json=CHAT)
            fourth = await client.post("/v1/chat/completions", json=CHAT)
            states = [breaker_of(router, w.url).state for w in fleet]
    assert (first.status_code, second.status_code) == (503, 503)
    assert second.json()["error"]["type"] == "server_error"  # the worker's body, not the router's
    assert (third.status_code, fourth.status_code) == (200, 200)
    assert third.headers["x-router-worker"] == fourth.headers["x-router-worker"] == fleet[1].url
    # The fourth request no longer reaches the open worker: only the recovered one is a candidate.
    assert [dispatches(w) for w in fleet] == [3, 4]
    assert states == [BreakerState.OPEN, BreakerState.CLOSED]


async def test_all_open_reject_answers_503_with_retry_after_until_the_earliest_probe() -> None:
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503, ALWAYS_503],
            breaker_failure_threshold=1,
            breaker_all_open="reject",
            policy="round_robin",
            breaker_cooldown_s=5.0,
            breaker_max_cooldown_s=60.0,
        ) as (fleet, router, client):
            first = await client.post("/v1/chat/completions", json=CHAT)
            earliest = min(breaker_of(router, w.url).next_probe_at or math.inf for w in fleet)
            before = trio.current_time()
            rejected = await client.post("/v1/chat/completions", json=CHAT)
            after = trio.current_time()
    assert first.status_code == 503 and first.json()["error"]["type"] == "server_error"
    assert rejected.status_code == 503
    assert rejected.json()["error"]["code"] == "no_available_workers"
    assert "breaker open" in rejected.json()["error"]["message"]
    seconds = int(rejected.headers["retry-after"])
    assert math.ceil(earliest - after) <= seconds <= math.ceil(earliest - before)
    assert 1 <= seconds <= 5
    assert [dispatches(w) for w in fleet] == [1, 1]


# -- recovery ---------------------------------------------------------------------------


async def test_after_the_cooldown_the_recovered_worker_is_probed_and_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router")
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503, HEALTHY],
            policy="round_robin",
            breaker_failure_threshold=1,
            breaker_cooldown_s=0.5,
            breaker_max_cooldown_s=1.0,
        ) as (fleet, router, client):
            tripped = await client.post("/v1/chat/completions", json=CHAT)
            stats = breaker_of(router, fleet[0].url)
            assert stats.state is BreakerState.OPEN and stats.next_probe_at is not None
            fleet[0].worker.behaviour.update({"fail_first": 0})
            fleet[0].worker.routing.reset()
            # The cooldown is a span of time, not a condition to poll for.
            await trio.sleep_until(stats.next_probe_at)
            answered_by = []
            request_ids = {}
            for _ in range(2):
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200
                answered_by.append(response.headers["x-router-worker"])
                request_ids[response.headers["x-router-worker"]] = response.headers["x-request-id"]
            after = breaker_of(router, fleet[0].url)
    assert tripped.status_code == 200
    assert fleet[0].url in answered_by
    assert dispatches(fleet[0]) == answered_by.count(fleet[0].url)
    assert (after.state, after.consecutive_faults, after.cooldown_s) == (
        BreakerState.CLOSED,
        0,
        0.5,
    )
    # One line per trip, per probe and per recovery; trip and probe name their request.
    lines = [
        r.getMessage()
        for r in caplog.records
        if fleet[0].url in r.getMessage() and r.levelno >= logging.INFO
    ]
    assert [line for line in lines if "breaker" in line or "probing" in line] == [
        f"breaker of {fleet[0].url} opened (was closed) [request {tripped.headers['x-request-id']}]",
        f"probing {fleet[0].url}: its breaker cooldown is over [request {request_ids[fleet[0].url]}]",
        f"breaker of {fleet[0].url} closed: the worker recovered",
    ]


# -- what the operator sees -------------------------------------------------------------


async def test_workers_listing_and_metrics_show_the_breaker() -> None:
    with trio.fail_after(GUARD_S):
        async with fleet_behind_router(
            [ALWAYS_503, HEALTHY], breaker_failure_threshold=1, **NO_PROBE
        ) as (fleet, _, client):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            listing = (await client.get("/v1/workers")).json()["workers"]
            states = await scrape(client, "router_worker_breaker_state")
            trips = await scrape(client, "router_worker_breaker_trips_total")
            retried = await retries(client)
    by_url = {entry["url"]: entry["breaker"] for entry in listing}
    bad, good = by_url[fleet[0].url], by_url[fleet[1].url]
    assert {k: bad[k] for k in ("state", "consecutive_faults", "cooldown_s", "trips")} == {
        "state": "open",
        "consecutive_faults": 1,
        "cooldown_s": 60.0,
        "trips": 1,
    }
    assert 55 < bad["next_probe_in_s"] <= 60
    assert good == {
        "state": "closed",
        "consecutive_faults": 0,
        "cooldown_s": 60.0,
        "next_probe_in_s": None,
        "trips": 0,
    }
    assert states == {(("worker", fleet[0].url),): 1.0, (("worker", fleet[1].url),): 0.0}
    assert trips == {(("worker", fleet[0].url),): 1.0}
    assert retried == {"status_503": 1}

"""An attempt that fails in a way no upstream error explains: 502 naming the worker, never
a bare 500; no verdict on the worker's breaker, and its lease released."""

from __future__ import annotations

import logging

import pytest
import trio

from router.fleet.records import Role, WorkerRecord
from tests.adversarial.upstream_stubs import chat, open_edge
from tests.support.raw_upstream import Exchange

GUARD_S = 30


async def never_called(exchange: Exchange) -> None:
    raise AssertionError("no request may reach a worker here")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_an_unexpected_exception_answers_502_naming_the_worker(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # A record built around the parser's checks (as a bug elsewhere could): the pool
    # refuses its URL with a ValueError, which is no upstream error.
    bad_url = "http://127.0.0.1:1/a b"
    with trio.fail_after(GUARD_S):
        async with open_edge(never_called, max_attempts=2) as edge:
            edge.router.fleet.upsert(WorkerRecord(id="hand-made", url=bad_url, models=("n",)))
            with caplog.at_level(logging.ERROR, logger="router.dispatch"):
                response = await edge.client.post(
                    "/v1/chat/completions", json=chat(stream=stream, model="n")
                )
            assert response.status_code == 502
            error = response.json()["error"]
            assert error["code"] == "worker_unreachable"
            assert bad_url in error["message"] and "InvalidWorkerUrl" in error["message"]
            listing = await edge.workers()
            assert listing[bad_url]["inflight"] == 0
            assert listing[bad_url]["breaker"] is None  # the suite runs without breakers
            assert await edge.counter("router_retries_total") == {}
            assert any("failed unexpectedly" in record.getMessage() for record in caplog.records)
            await edge.assert_no_harm_left()


async def test_an_unexpected_exception_gives_the_breaker_no_verdict() -> None:
    bad_url = "http://127.0.0.1:1/a b"
    with trio.fail_after(GUARD_S):
        async with open_edge(never_called, breaker_failure_threshold=1) as edge:
            edge.router.fleet.upsert(WorkerRecord(id="hand-made", url=bad_url, models=("n",)))
            for _ in range(3):
                response = await edge.client.post("/v1/chat/completions", json=chat(model="n"))
                assert response.status_code == 502
            breaker = (await edge.workers())[bad_url]["breaker"]
            assert (breaker["state"], breaker["consecutive_faults"], breaker["trips"]) == (
                "closed",
                0,
                0,
            )


async def test_an_unexpected_exception_in_a_pd_leg_answers_502_and_releases_both_leases() -> None:
    bad_url = "http://127.0.0.1:1/a b"
    with trio.fail_after(GUARD_S):
        async with open_edge(never_called) as edge:
            fleet = edge.router.fleet
            fleet.upsert(
                WorkerRecord(
                    id="prefill-1",
                    url=bad_url,
                    models=("pd",),
                    role=Role.PREFILL,
                    disagg_meta={
                        "protocol": "mooncake",
                        "params": {"bootstrap_addr": "127.0.0.1:8998"},
                    },
                )
            )
            fleet.upsert(
                WorkerRecord(id="decode-1", url=edge.good.url, models=("pd",), role=Role.DECODE)
            )
            response = await edge.client.post("/v1/chat/completions", json=chat(model="pd"))
            assert response.status_code == 502
            assert bad_url in response.json()["error"]["message"]
            inflight = {w.id: w.inflight for w in fleet.workers()}
            assert inflight["prefill-1"] == inflight["decode-1"] == 0
            await edge.assert_no_harm_left()

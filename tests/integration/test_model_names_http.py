"""Aliases and fallbacks through a router on loopback, in front of fake workers that each
serve one model and answer 404 for any other (so a body that reached a worker with the
wrong `model` fails the test by itself).

What is asserted is what the client got (status, the answer's `model`, the marks) and what
each worker received (its dispatch count)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import trio

from router.cli.serve import RunningRouter
from router.fake_worker.behaviour import FailMode
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import Status
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

GUARD_S = 30


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@asynccontextmanager
async def open_models(
    models: Sequence[str], **overrides: Any
) -> AsyncIterator[tuple[list[FakeWorkerHandle], RunningRouter, httpx.AsyncClient]]:
    """One fake worker per model, a router in front of them, and a client of the router."""
    settings = [FakeWorkerSettings(model=model, tokens=3) for model in models]
    async with (
        open_fake_fleet(settings) as fleet,
        open_router(
            [f"{handle.url},model={handle.settings.model}" for handle in fleet], **overrides
        ) as router,
        httpx.AsyncClient(base_url=router.url, timeout=GUARD_S) as client,
    ):
        yield fleet, router, client


def _dispatches(fleet: list[FakeWorkerHandle]) -> list[int]:
    return [handle.worker.routing.dispatches for handle in fleet]


async def test_an_alias_is_listed_and_served_by_its_model_whose_name_the_answer_keeps() -> None:
    with trio.fail_after(GUARD_S):
        async with open_models(
            ["llama-v1", "other"], model_aliases=(("chat", (("llama-v1", 1.0),)),)
        ) as (fleet, _, client):
            listed = [entry["id"] for entry in (await client.get("/v1/models")).json()["data"]]
            unary = await client.post("/v1/chat/completions", json=_chat("chat"))
            async with client.stream(
                "POST", "/v1/chat/completions", json=_chat("chat", stream=True)
            ) as stream:
                text = (await stream.aread()).decode()
                stream_mark = stream.headers["x-router-model"]
            scrape = (await client.get("/metrics")).text
    assert listed == ["chat", "llama-v1", "other"]
    assert unary.status_code == 200
    assert unary.json()["model"] == "llama-v1"
    assert unary.headers["x-router-model"] == "llama-v1"
    assert "x-router-fallback-from" not in unary.headers
    assert stream_mark == "llama-v1"
    assert '"model":"llama-v1"' in text and '"model":"chat"' not in text
    assert _dispatches(fleet) == [2, 0]
    assert 'router_model_rewrites_total{alias="chat",model="llama-v1"} 2.0' in scrape


async def test_with_alias_answers_the_answer_names_the_alias_unary_and_streamed() -> None:
    with trio.fail_after(GUARD_S):
        async with open_models(
            ["llama-v1"],
            model_aliases=(("chat", (("llama-v1", 1.0),)),),
            alias_answer_model="alias",
        ) as (fleet, _, client):
            unary = await client.post("/v1/chat/completions", json=_chat("chat"))
            async with client.stream(
                "POST", "/v1/completions", json={"model": "chat", "prompt": "x", "stream": True}
            ) as stream:
                text = (await stream.aread()).decode()
            direct = await client.post("/v1/chat/completions", json=_chat("llama-v1"))
    assert unary.json()["model"] == "chat"
    assert unary.headers["x-router-model"] == "llama-v1"
    events = [line for line in text.split("\n") if line.startswith("data: {")]
    assert len(events) >= 3
    assert all(orjson.loads(line[6:])["model"] == "chat" for line in events)
    # A request for the served model by its own name is no alias request: nothing changes.
    assert direct.json()["model"] == "llama-v1"
    assert "x-router-model" not in direct.headers
    assert _dispatches(fleet) == [3]


async def test_a_model_with_no_worker_that_can_take_it_falls_back_and_says_so() -> None:
    with trio.fail_after(GUARD_S):
        async with open_models(["big", "small"], model_fallbacks=(("big", ("small",)),)) as (
            fleet,
            router,
            client,
        ):
            big = router.fleet.workers()[0]
            assert big.record.models == ("big",)
            # The big model's worker is there, draining: its requests are 503s without a fallback.
            router.fleet.upsert(dataclasses.replace(big.record, status=Status.DRAINING))
            answers = [
                await client.post("/v1/chat/completions", json=_chat("big")) for _ in range(4)
            ]
            unknown = await client.post("/v1/chat/completions", json=_chat("huge"))
            scrape = (await client.get("/metrics")).text
    assert [answer.status_code for answer in answers] == [200] * 4
    assert {answer.json()["model"] for answer in answers} == {"small"}
    assert {answer.headers["x-router-fallback-from"] for answer in answers} == {"big"}
    assert {answer.headers["x-router-model"] for answer in answers} == {"small"}
    # An unknown model stays a 404: no fallback is ever tried for it.
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert _dispatches(fleet) == [0, 4]
    assert 'router_model_fallbacks_total{fallback="small",model="big"} 4.0' in scrape


async def test_a_model_served_normally_never_touches_its_fallback() -> None:
    with trio.fail_after(GUARD_S):
        async with open_models(["big", "small"], model_fallbacks=(("big", ("small",)),)) as (
            fleet,
            _,
            client,
        ):
            answers = [
                await client.post("/v1/chat/completions", json=_chat("big")) for _ in range(3)
            ]
    assert [answer.json()["model"] for answer in answers] == ["big"] * 3
    assert all("x-router-fallback-from" not in answer.headers for answer in answers)
    assert _dispatches(fleet) == [3, 0]


async def test_workers_that_fail_before_the_first_byte_hand_the_request_to_the_fallback() -> None:
    with trio.fail_after(GUARD_S):
        async with open_models(
            ["big", "big", "small"], model_fallbacks=(("big", ("small",)),), max_attempts=3
        ) as (fleet, _, client):
            for handle in fleet[:2]:
                handle.worker.behaviour.update({"fail_first": -1, "fail_mode": FailMode.RESET})
            answer = await client.post("/v1/chat/completions", json=_chat("big"))
    assert answer.status_code == 200
    assert answer.json()["model"] == "small"
    assert answer.headers["x-router-fallback-from"] == "big"
    assert _dispatches(fleet) == [1, 1, 1]


async def test_a_canary_with_no_worker_yet_gives_its_share_to_the_stable_model() -> None:
    draws = iter([0.99, 0.99, 0.1])
    with trio.fail_after(GUARD_S):
        async with open_models(
            ["llama-v1"], model_aliases=(("chat", (("llama-v1", 95.0), ("llama-v2", 5.0))),)
        ) as (fleet, router, client):
            router.app.generation.draw = lambda: next(draws)
            answers = [
                await client.post("/v1/chat/completions", json=_chat("chat")) for _ in range(3)
            ]
    assert [answer.status_code for answer in answers] == [200] * 3
    assert [answer.headers.get("x-router-fallback-from") for answer in answers] == [
        "llama-v2",
        "llama-v2",
        None,
    ]
    assert _dispatches(fleet) == [3]


async def test_no_fallback_after_the_first_byte() -> None:
    with trio.fail_after(GUARD_S):
        async with open_models(["big", "small"], model_fallbacks=(("big", ("small",)),)) as (
            fleet,
            _,
            client,
        ):
            fleet[0].worker.behaviour.update(
                {"fail_first": -1, "fail_mode": FailMode.MIDSTREAM, "fail_after_chunks": 1}
            )
            async with client.stream(
                "POST", "/v1/chat/completions", json=_chat("big", stream=True)
            ) as stream:
                status = stream.status_code
                text = (await stream.aread()).decode()
    assert status == 200
    assert "event: error" in text
    assert _dispatches(fleet) == [1, 0]

"""LoRA adapters through a router on loopback, in front of fake vLLM engines that hold
different adapters and answer 404 for any adapter they lack (so a request that reached
the wrong engine shows in what the client got).

What is asserted is what the client got and what each engine received (its dispatch
count, and how often its model list was read)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from router.cli.serve import RunningRouter
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

GUARD_S = 30
BASE = "base"


def _completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 2}


@asynccontextmanager
async def open_adapter_fleet(
    adapter_sets: Sequence[tuple[str, ...]], **overrides: Any
) -> AsyncIterator[tuple[list[FakeWorkerHandle], RunningRouter, httpx.AsyncClient]]:
    """One fake vLLM engine per adapter set (all of base model `base`), a router in front
    of them that knows their model but not their adapters, and a client of the router;
    the block runs once the router learned every engine's adapters."""
    settings = [
        FakeWorkerSettings(model=BASE, engine="vllm", tokens=2, lora_adapters=adapters)
        for adapters in adapter_sets
    ]
    async with (
        open_fake_fleet(settings) as fleet,
        open_router([f"{handle.url},model={BASE}" for handle in fleet], **overrides) as router,
        httpx.AsyncClient(base_url=router.url, timeout=GUARD_S) as client,
    ):
        wanted = {name for adapters in adapter_sets for name in adapters}
        await wait_until(lambda: set(router.fleet.adapters()) == wanted)
        yield fleet, router, client


async def _post(client: httpx.AsyncClient, url: str, model: str) -> None:
    answer = await client.post(url, json=_completion(model))
    assert answer.status_code == 200


def _dispatches(fleet: list[FakeWorkerHandle]) -> list[int]:
    return [handle.worker.routing.dispatches for handle in fleet]


async def test_adapters_are_listed_with_their_parent_and_planned_over_the_engines_holding_them() -> (
    None
):
    with trio.fail_after(GUARD_S):
        async with open_adapter_fleet([("x", "y"), ("y",)]) as (fleet, _, client):
            listed = (await client.get("/v1/models")).json()["data"]
            only_x = [await client.post("/v1/completions", json=_completion("x")) for _ in range(4)]
            x_cost = _dispatches(fleet)
            both_y = [await client.post("/v1/completions", json=_completion("y")) for _ in range(4)]
            workers = (await client.get("/v1/workers")).json()["workers"]
    assert [(entry["id"], entry.get("parent")) for entry in listed] == [
        (BASE, None),
        ("x", BASE),
        ("y", BASE),
    ]
    assert [answer.status_code for answer in only_x + both_y] == [200] * 8
    assert x_cost == [4, 0]
    assert _dispatches(fleet) == [6, 2]  # round robin over the two holders of y
    assert [worker["adapters"] for worker in workers] == [{"x": BASE, "y": BASE}, {"y": BASE}]


async def test_an_adapter_no_engine_holds_is_404_and_one_whose_engines_are_all_down_is_503() -> (
    None
):
    with trio.fail_after(GUARD_S):
        async with open_adapter_fleet([("x",), ()]) as (fleet, router, client):
            unknown = await client.post("/v1/completions", json=_completion("z"))
            holder = router.fleet.get(fleet[0].url)
            assert holder is not None
            holder.healthy = False
            down = await client.post("/v1/completions", json=_completion("x"))
            base = await client.post("/v1/completions", json=_completion(BASE))
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "no_available_workers"
    assert "model 'x'" in down.json()["error"]["message"]
    assert base.status_code == 200  # the base model's other engine serves on
    assert _dispatches(fleet) == [0, 1]


async def test_an_engine_that_lost_an_adapter_is_a_routing_miss_failed_over_before_any_byte() -> (
    None
):
    # The lists are read once at the start; only the miss asks for one again.
    with trio.fail_after(GUARD_S):
        async with open_adapter_fleet(
            [("x",), ("x",)], adapter_list_interval_s=3600.0, breaker_failure_threshold=1
        ) as (fleet, router, client):
            lister = fleet[1].worker
            lists_read = lister.routing.paths.get("/v1/models", 0)
            lister.behaviour.lora_adapters = ()  # unloaded behind the router's back
            answers = [
                await client.post("/v1/completions", json=_completion("x")) for _ in range(4)
            ]
            await wait_until(lambda: lister.routing.paths.get("/v1/models", 0) > lists_read)
            stream = await client.post("/v1/completions", json={**_completion("x"), "stream": True})
            missed = router.fleet.get(fleet[1].url)
            metrics = (await client.get("/metrics")).text
    assert [answer.status_code for answer in answers] == [200] * 4
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    # One request met the miss on the second engine and went on to the first.
    assert _dispatches(fleet) == [5, 1]
    assert missed is not None and "x" not in missed.adapters.held
    assert missed.breaker is not None and missed.breaker.statistics(0.0).consecutive_faults == 0
    assert "router_adapter_misses_total 1.0" in metrics
    assert 'router_retries_total{reason="adapter_missing"} 1.0' in metrics


async def test_the_last_engine_losing_an_adapter_answers_its_own_404_and_the_adapter_is_gone() -> (
    None
):
    with trio.fail_after(GUARD_S):
        async with open_adapter_fleet(
            [("x",)], adapter_list_interval_s=3600.0, model_memory_s=0.0
        ) as (fleet, router, client):
            fleet[0].worker.behaviour.lora_adapters = ()
            first = await client.post("/v1/completions", json=_completion("x"))
            second = await client.post("/v1/completions", json=_completion("x"))
    assert first.status_code == 404
    assert first.json()["error"]["type"] == "NotFoundError"  # the engine's own answer
    assert second.status_code == 404
    assert second.json()["error"]["code"] == "model_not_found"  # the router's: no holder
    assert _dispatches(fleet) == [1]
    assert router.fleet.adapters() == {}


async def test_least_load_sends_an_adapter_to_the_engine_running_it_not_the_lighter_one_where_it_waits() -> (
    None
):
    # Two engines with one adapter slot each: e0 runs one request of b, e1 two of a (sent
    # to them directly, as another router would). Counting load alone, e0 is the lighter;
    # a request for a would wait there for b's slot. The engines' own
    # `vllm:lora_requests_info` tells the router, which sends all three to e1.
    with trio.fail_after(GUARD_S):
        async with open_adapter_fleet(
            [("a", "b"), ("a", "b")], policy="least_load", spread_margin=0.0
        ) as (fleet, router, client):
            for handle in fleet:
                handle.worker.hold_answers()
            async with trio.open_nursery() as nursery:
                direct = [(fleet[0], "b"), (fleet[1], "a"), (fleet[1], "a")]
                for handle, model in direct:
                    nursery.start_soon(_post, client, f"{handle.url}/v1/completions", model)
                engines = [router.fleet.get(handle.url) for handle in fleet]

                def slots_read() -> bool:
                    activity = [engine.adapters.activity if engine else None for engine in engines]
                    return [a.running if a else None for a in activity] == [{"b"}, {"a"}] and all(
                        engine is not None and engine.load == load
                        for engine, load in zip(engines, (1, 2), strict=True)
                    )

                await wait_until(slots_read)
                for _ in range(3):
                    nursery.start_soon(_post, client, "/v1/completions", "a")
                await wait_until(lambda: sum(_dispatches(fleet)) == 6)
                workers = (await client.get("/v1/workers")).json()["workers"]
                for handle in fleet:
                    handle.worker.release_answers()
    assert _dispatches(fleet) == [1, 5]
    assert workers[0]["adapter_slots"] == {"max_loras": 1, "running": ["b"], "waiting": ["b"]}

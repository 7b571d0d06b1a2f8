"""`kv_aware` in front of `grpc://` workers: the router reads each engine's KV-cache events
from its gRPC service (`SubscribeKvEvents`) and routes by them, and tells a whole view
from one it cannot trust. Two fake gRPC engines with a prefix cache and the servicer's
live-only event stream (docs/fake-worker.md), a router in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from smg_grpc_proto.generated import common_pb2

from router.http.grpc import open_grpc_pool
from tests.support.failover import scrape
from tests.support.grpc_fake_process import FakeGrpcEngine, fake_grpc_engine
from tests.support.router_instance import open_router

MODEL = "m"
GUARD_S = 30.0
BLOCK = 16  # the fake's block
PROMPT = list(range(100, 100 + 3 * BLOCK + 5))  # three full blocks and a tail
OTHER = list(range(900, 900 + 3 * BLOCK + 5))
HELD = 3 * BLOCK
SENDS = 4
FLUSH = "/vllm.grpc.engine.VllmEngine/FlushCache"


@pytest.fixture
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeGrpcEngine, ...]]:
    # Fresh per test: a view is whole only when the router saw the engine's first batch.
    model_dir = tmp_path_factory.mktemp("model")
    flags = ("--model", MODEL, "--tokens", "1", "--cache-tokens", "4096", "--kv-events")
    with fake_grpc_engine(model_dir, *flags) as a, fake_grpc_engine(model_dir, *flags) as b:
        yield a, b


@asynccontextmanager
async def router_before(*engines: FakeGrpcEngine, **overrides: Any) -> AsyncIterator[Any]:
    overrides.setdefault("policy", "kv_aware")
    async with (
        open_router([f"{e.url},model={MODEL}" for e in engines], **overrides) as running,
        httpx.AsyncClient(base_url=running.url, timeout=GUARD_S) as client,
    ):
        yield client


async def kv_events(engine: FakeGrpcEngine) -> dict[str, Any]:
    events: dict[str, Any] = (await engine.routing())["kv_events"]
    return events


async def until_subscribed(*engines: FakeGrpcEngine, opened: int = 1) -> None:
    """Until each engine has a live subscription, its `opened`-th."""
    for engine in engines:
        while True:
            events = await kv_events(engine)
            if events["subscriptions_live"] == 1 and events["subscriptions_opened"] >= opened:
                break
            await trio.sleep(0.05)


async def views(client: httpx.AsyncClient) -> tuple[float, float]:
    found = await scrape(client, "router_kv_index_views")
    known = found.get((("model", MODEL), ("state", "known")), 0.0)
    unknown = found.get((("model", MODEL), ("state", "unknown")), 0.0)
    return known, unknown


async def until_views(client: httpx.AsyncClient, known: int, unknown: int) -> None:
    while True:
        if await views(client) == (known, unknown):
            return
        await trio.sleep(0.05)


async def counter(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The sum of `name`'s samples carrying `labels` (and any others)."""
    found = await scrape(client, name)
    wanted = set(labels.items())
    return sum(value for key, value in found.items() if wanted <= set(key))


async def until_counter(client: httpx.AsyncClient, name: str, at_least: float) -> None:
    while True:
        if await counter(client, name) >= at_least:
            return
        await trio.sleep(0.05)


async def send(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str, int]:
    """One completion: the worker that served it and the engine's cached prompt tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return response.headers["x-router-worker"], int(details.get("cached_tokens") or 0)


async def warm(engine: FakeGrpcEngine, prompt: list[int]) -> None:
    """Send `prompt` to `engine` past the router under test (another router, its only
    worker)."""
    async with router_before(engine, policy="round_robin") as other:
        assert (await send(other, prompt))[0] == engine.url


async def test_the_engine_warmed_past_the_router_gets_the_prompt_and_the_hits_agree(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    cold, hot = engines
    with trio.fail_after(GUARD_S):
        async with router_before(cold, hot) as client:
            await until_subscribed(cold, hot)
            # Nothing seen from either yet: neither view is read as empty.
            assert await views(client) == (0, 2)
            await warm(hot, PROMPT)
            await until_views(client, known=1, unknown=1)
            for _ in range(SENDS):
                assert await send(client, PROMPT) == (hot.url, HELD)
            predicted = await counter(client, "router_kv_aware_predicted_hit_tokens_total")
            matched = await counter(client, "router_kv_aware_picks_total", reason="match")
    assert (predicted, matched) == (SENDS * HELD, SENDS)
    assert (await cold.routing())["dispatches"] == 0


async def test_data_loss_a_skipped_batch_and_a_late_join_leave_the_view_unknown(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    with trio.fail_after(GUARD_S):
        async with router_before(a, b) as client:
            await until_subscribed(a, b)
            await warm(a, PROMPT)
            await warm(b, OTHER)
            await until_views(client, known=2, unknown=0)
            # DATA_LOSS: subscribed again at once, and what b cached before is unseen.
            async with httpx.AsyncClient(timeout=GUARD_S) as http:
                (await http.post(b.debug + "/debug/kv_events/data_loss")).raise_for_status()
            await until_subscribed(b, opened=2)
            assert await counter(client, "router_kv_events_restarts_total") == 1
            await until_views(client, known=1, unknown=1)
            batches = await counter(client, "router_kv_events_batches_total")
            await warm(b, PROMPT)
            await until_counter(client, "router_kv_events_batches_total", batches + 1)
            # b's next batch is applied, and does not make its view whole.
            assert await views(client) == (1, 1)
            # A skipped batch: a's view is unknown, counted as a gap.
            async with httpx.AsyncClient(timeout=GUARD_S) as http:
                skip = await http.post(a.debug + "/debug/kv_events/skip", json={"batches": 3})
                skip.raise_for_status()
            await warm(a, OTHER)
            await until_views(client, known=0, unknown=2)
            assert await counter(client, "router_kv_events_gaps_total") == 1
            # An unknown candidate is never read as holding nothing, nor as a hit.
            await send(client, PROMPT)
            assert await counter(client, "router_kv_aware_unknown_candidates_total") >= 2
            assert await counter(client, "router_kv_aware_picks_total", reason="match") == 0


async def test_a_cleared_cache_makes_an_unknown_view_whole_again(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    with trio.fail_after(GUARD_S):
        await warm(a, PROMPT)  # before the router: it joins late
        async with router_before(a, b) as client:
            await until_subscribed(a, b)
            await warm(a, OTHER)
            await until_views(client, known=0, unknown=2)
            async with open_grpc_pool() as pool:
                await pool.unary(a.url, FLUSH, common_pb2.FlushCacheRequest().SerializeToString())
            await until_views(client, known=1, unknown=1)
            await warm(a, PROMPT)
            assert await send(client, PROMPT) == (a.url, HELD)


async def test_an_engine_without_kv_events_is_unknown_and_asked_again_slowly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tmp_path_factory.mktemp("model")
    with fake_grpc_engine(model_dir, "--model", MODEL, "--tokens", "1") as plain:
        with trio.fail_after(GUARD_S):
            async with router_before(plain) as client:
                # UNIMPLEMENTED: the stream ended once, the view unknown, no retry storm.
                await until_counter(client, "router_kv_events_disconnects_total", 1)
                await send(client, PROMPT)
                await trio.sleep(1.0)  # twice the first backoff after a broken stream
                assert await views(client) == (0, 1)
                assert await counter(client, "router_kv_events_disconnects_total") == 1

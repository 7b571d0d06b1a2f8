"""`kv_aware` over gRPC on real vLLM engines: the router reads each engine's KV-cache events
from its gRPC service (`SubscribeKvEvents`, the servicer relaying vLLM's ZMQ publisher)
and sends a prompt to the engine whose cache holds it, though this router never routed it
there (another router warmed it); the engine's own count of cached prompt tokens and the
router's predicted hits agree. The servicer streams live only: a router that joins warm
engines keeps their views unknown (never read as empty), and a restarted engine is
subscribed to again before its first batch, so its view is known again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from conformance.engines import Engine, EngineSettings
from conformance.processes import free_port
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import RouterProcess, kv_events_engine, metric_sum, open_router, scrape

MODEL = "tiny"
BLOCK = 32
# Six full blocks of token ids and a tail of five: the engine caches the six.
PROMPT = list(range(10, 10 + 6 * BLOCK + 5))
OTHER_PROMPT = list(range(400, 400 + 6 * BLOCK + 5))  # the tiny model has ~1,100 ids
HELD_TOKENS = 6 * BLOCK
SENDS = 4
# The servicer's relay subscribes to the engine's ZMQ publisher when the call arrives; a
# batch published in the next moments can miss it (ZMQ's slow joiner). No router
# request comes that soon in service; here the test waits this long after the calls are
# open.
RELAY_JOIN_S = 2.0


def kv_grpc_engine(scratch: Path) -> EngineSettings:
    # The publisher on an ipc socket: vLLM binds it (it connects a tcp://127.0.0.1 one),
    # and it stays on this host.
    return kv_events_engine(
        MODEL,
        BLOCK,
        endpoint=f"ipc://{scratch}/kv-{free_port()}.sock",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        protocol="grpc",
    )


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    scratch = tmp_path_factory.mktemp("kv-events")
    yield from host_engines([kv_grpc_engine(scratch), kv_grpc_engine(scratch)], name="grpc-kv")


def worker_args(*engines: Engine) -> list[str]:
    return [a for e in engines for a in ("--worker", f"{e.url},model={MODEL}")]


async def subscribed(client: httpx.AsyncClient, router: RouterProcess, count: int) -> None:
    """Until `count` gRPC calls are open at the router with no request in flight (its
    event streams), then the relay's join time."""
    while True:
        samples = await scrape(client, router.url)
        if (metric_sum(samples, "router_grpc_calls", state="open") or 0) >= count:
            break
        await trio.sleep(0.2)
    await trio.sleep(RELAY_JOIN_S)


async def views(client: httpx.AsyncClient, router: RouterProcess) -> tuple[float, float]:
    samples = await scrape(client, router.url)
    known = metric_sum(samples, "router_kv_index_views", model=MODEL, state="known") or 0
    unknown = metric_sum(samples, "router_kv_index_views", model=MODEL, state="unknown") or 0
    return known, unknown


async def until_views(
    client: httpx.AsyncClient, router: RouterProcess, known: int, unknown: int
) -> None:
    while True:
        if await views(client, router) == (known, unknown):
            return
        await trio.sleep(0.2)


async def send(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[str, Any]:
    """One unary completion: the engine that served it and the answer's usage."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers.get("x-router-worker", ""), response.json()["usage"]


def cached(usage: Any) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def test_the_engine_another_router_warmed_gets_the_prompt_and_the_hits_agree(
    host: EngineHost,
) -> None:
    cold, warm = host.engines
    args = [*worker_args(cold, warm), "--policy", "kv_aware"]
    with trio.fail_after(300):
        async with (
            httpx.AsyncClient(timeout=60) as client,
            open_router(*args) as router,
        ):
            await subscribed(client, router, 2)
            # Both fresh: nothing seen yet from either, so neither view is read as empty.
            assert await views(client, router) == (0, 2)
            async with open_router(*worker_args(warm), name="other-router") as other:
                served, usage = await send(client, other.url, PROMPT)
            assert served == warm.url and cached(usage) == 0
            # The warm engine's first batch reached this router: its view is whole.
            await until_views(client, router, known=1, unknown=1)
            for _ in range(SENDS):
                served, usage = await send(client, router.url, PROMPT)
                assert served == warm.url
                assert cached(usage) == HELD_TOKENS
            samples = await scrape(client, router.url)
    predicted = metric_sum(samples, "router_kv_aware_predicted_hit_tokens_total")
    assert predicted == SENDS * HELD_TOKENS  # the engine's own count: a match rate of 1
    assert metric_sum(samples, "router_kv_aware_picks_total", reason="match") == SENDS
    assert metric_sum(samples, "router_kv_events_decode_errors_total") == 0
    assert (metric_sum(samples, "router_kv_events_received_total", type="BlockStored") or 0) >= 1
    print(f"{SENDS} of {SENDS} to the engine another router warmed, {predicted:.0f} hit tokens")


async def test_a_router_joining_warm_engines_keeps_their_views_unknown(
    host: EngineHost,
) -> None:
    args = [*worker_args(*host.engines), "--policy", "kv_aware"]
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=60) as client:
            # Both engines warm (their first batches past) before this router starts.
            for engine in host.engines:
                async with open_router(*worker_args(engine), name="other-router") as other:
                    await send(client, other.url, PROMPT)
        async with (
            httpx.AsyncClient(timeout=60) as client,
            open_router(*args) as router,
        ):
            await subscribed(client, router, 2)
            for _ in range(4):
                await send(client, router.url, OTHER_PROMPT)
            samples = await scrape(client, router.url)
            assert await views(client, router) == (0, 2)
    assert (metric_sum(samples, "router_kv_aware_unknown_candidates_total") or 0) >= 4
    assert (metric_sum(samples, "router_kv_events_batches_total") or 0) >= 1
    assert metric_sum(samples, "router_kv_aware_picks_total", reason="match") in (0, None)


async def test_a_restarted_engine_is_subscribed_to_before_its_first_batch(
    host: EngineHost,
) -> None:
    args = [*worker_args(*host.engines), "--policy", "kv_aware", "--health-interval-s", "1"]
    victim = host.engines[0]
    with trio.fail_after(600):
        async with (
            httpx.AsyncClient(timeout=60) as client,
            open_router(*args) as router,
        ):
            await subscribed(client, router, 2)
            assert await views(client, router) == (0, 2)
            restart_s = await host.restart(victim)
            # Healthy again at the router; then its stream is open again (within 1 s).
            while True:
                listed = (await client.get(f"{router.url}/v1/workers")).json()["workers"]
                if all(w.get("healthy") for w in listed):
                    break
                await trio.sleep(0.2)
            await subscribed(client, router, 2)
            async with open_router(*worker_args(victim), name="other-router") as other:
                served, _ = await send(client, other.url, PROMPT)
            assert served == victim.url
            await until_views(client, router, known=1, unknown=1)
            for _ in range(SENDS):
                served, usage = await send(client, router.url, PROMPT)
                assert served == victim.url and cached(usage) == HELD_TOKENS
    print(f"restarted in {restart_s:.0f} s; its view known again from its first batch")

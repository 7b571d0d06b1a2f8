"""`kv_aware` on real vLLM engines: the router finds each engine's KV-event publisher on
its `/kv_event_sources`, decodes every batch and replay answer the engine sends, and sends
a prompt to the engine whose cache holds it, though the router never routed it there
(the cache was warmed directly) and again after the router restarts (its view rebuilt
from the engines' replay buffers). The router's predicted hits equal the engine's own
count of prefix-cache hits: a match rate of 1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trio

from conformance.engines import Engine
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import RouterProcess, kv_events_engine, metric_sum, open_router, scrape

MODEL = "tiny"
BLOCK = 32
# Six full blocks of token ids and a tail of five: the engine caches the six.
PROMPT = list(range(10, 10 + 6 * BLOCK + 5))
HELD_TOKENS = 6 * BLOCK
SENDS = 4


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    yield from host_engines(
        [kv_events_engine(MODEL, BLOCK), kv_events_engine(MODEL, BLOCK)], name="kv-aware"
    )


async def counters(client: httpx.AsyncClient, engine: Engine) -> tuple[float, float]:
    """The engine's finished requests and prefix-cache hit tokens."""
    samples = await scrape(client, engine.url)
    finished = metric_sum(samples, "vllm:request_success_total")
    hits = metric_sum(samples, "vllm:prefix_cache_hits_total")
    assert finished is not None and hits is not None, "the engine's counters are missing"
    return finished, hits


async def views_known(client: httpx.AsyncClient, router: RouterProcess, count: int) -> None:
    """Until the router holds `count` known views of the model (each engine's replay
    answered and applied)."""
    while True:
        samples = await scrape(client, router.url)
        if metric_sum(samples, "router_kv_index_views", model=MODEL, state="known") == count:
            return
        await trio.sleep(0.2)


async def send(client: httpx.AsyncClient, url: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text


async def test_the_engine_holding_the_prompt_gets_it_before_and_after_a_router_restart(
    host: EngineHost,
) -> None:
    cold, warm = host.engines
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=60) as client:
            await send(client, warm.url)  # past the router: only the events tell
            before = {e.url: await counters(client, e) for e in (cold, warm)}
            args = ("--worker", cold.url, "--worker", warm.url, "--policy", "kv_aware")
            for attempt in ("first router", "restarted router"):
                async with open_router(*args) as router:
                    await views_known(client, router, 2)
                    for _ in range(SENDS):
                        await send(client, router.url)
                    samples = await scrape(client, router.url)
                after = {e.url: await counters(client, e) for e in (cold, warm)}
                finished = {url: after[url][0] - before[url][0] for url in after}
                hits = after[warm.url][1] - before[warm.url][1]
                assert finished == {cold.url: 0, warm.url: SENDS}, (attempt, finished)
                assert hits == SENDS * HELD_TOKENS, (attempt, hits)
                predicted = metric_sum(samples, "router_kv_aware_predicted_hit_tokens_total")
                assert predicted == hits, (attempt, predicted, hits)  # a match rate of 1
                assert metric_sum(samples, "router_kv_aware_picks_total", reason="match") == SENDS
                assert metric_sum(samples, "router_kv_events_decode_errors_total") == 0
                assert metric_sum(samples, "router_kv_events_replay_failures_total") == 0
                assert (metric_sum(samples, "router_kv_events_batches_total") or 0) >= 1
                print(f"{attempt}: {SENDS} of {SENDS} to the warm engine, {hits:.0f} hit tokens")
                before = after


async def test_a_multi_turn_chat_is_predicted_as_the_engine_counts_its_hits(
    host: EngineHost,
) -> None:
    """A conversation through the router with `--kv-tokenizer` (the model's directory):
    each turn goes back to the engine that holds the turns before, and the router's
    predicted hits equal the engine's hit tokens, turn after turn: the router computes
    the engine's own tokens for chat, the model's answers included."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are the router's assistant. " * 12},
    ]
    args = ("--worker", host.engines[0].url, "--worker", host.engines[1].url)
    model_dir = str(host.engines[0].environment.model_dir)
    with trio.fail_after(300):
        async with (
            httpx.AsyncClient(timeout=60) as client,
            open_router(*args, "--policy", "kv_aware", "--kv-tokenizer", model_dir) as router,
        ):
            await views_known(client, router, 2)
            served: list[str] = []
            before = {e.url: await counters(client, e) for e in host.engines}
            predicted_before = 0.0
            for turn in range(4):
                messages.append({"role": "user", "content": f"Question {turn}: " + "why? " * 20})
                body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
                answer = await client.post(f"{router.url}/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                served.append(answer.headers["x-router-worker"])
                messages.append(
                    {
                        "role": "assistant",
                        "content": answer.json()["choices"][0]["message"]["content"],
                    }
                )
                samples = await scrape(client, router.url)
                predicted = metric_sum(samples, "router_kv_aware_predicted_hit_tokens_total") or 0
                after = {e.url: await counters(client, e) for e in host.engines}
                hits = sum(after[url][1] - before[url][1] for url in after)
                print(
                    f"turn {turn}: to {served[-1]}, predicted {predicted - predicted_before:.0f}, engine hits {hits:.0f}"
                )
                assert predicted - predicted_before == hits, (turn, predicted, hits)
                before, predicted_before = after, predicted
            assert len(set(served[1:])) == 1 and served[1] == served[0], served

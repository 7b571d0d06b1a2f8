"""LoRA adapters on two real vLLM engines, each with one adapter slot (`--max-loras 1`):
engine 0 holds adapters `a` and `b`, engine 1 holds `b` only. The adapters are written
here (`conformance/lora_adapters.py`, random weights). Judged by the engines' own
counters (`vllm:request_success_total`, their access logs' 404 lines):

- the router learns the adapters from the engines' model lists and lists them with their
  parent; requests for `a` all reach engine 0 and none reaches engine 1; an adapter no
  engine holds is a 404 that reaches no engine;
- with engine 0 running `a` in its only slot and engine 1 running a base-model request
  (the same load, read from the engines), every request for `b` goes to engine 1, whose
  slot is free, and none waits behind `a` on engine 0;
- an engine that unloaded an adapter the router thought it held answers 404 once: the
  request fails over to the other holder, the client sees 200, the breaker records
  nothing, and no later request for the adapter reaches that engine.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from conformance import lora_adapters
from conformance.engines import Engine, EngineEnvironment, EngineSettings
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import metric_sum, open_router, scrape

MODEL = "tiny"
HOLDINGS = (("a", "b"), ("b",))
ENGINE_404 = re.compile(r'"POST /v1/\S+ HTTP/1\.1" 404')
LONG_TOKENS = 1500
SHORT_TOKENS = 8


def lora_engine(held: tuple[str, ...], dirs: dict[str, Path]) -> EngineSettings:
    return EngineSettings(
        served_model_name=MODEL,
        extra_args=(
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            str(lora_adapters.RANK),
            "--lora-modules",
            *(f"{name}={dirs[name]}" for name in held),
            "--override-generation-config",
            '{"temperature": 0.0}',
        ),
        # /v1/unload_lora_adapter, for the routing miss.
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    environment = EngineEnvironment.from_env()
    out = tmp_path_factory.mktemp("lora")
    names = sorted({name for held in HOLDINGS for name in held})
    script = Path(lora_adapters.__file__)
    argv = [str(environment.python), str(script), str(environment.model_dir), str(out), *names]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    dirs = {name: out / name for name in names}
    settings = [lora_engine(held, dirs) for held in HOLDINGS]
    yield from host_engines(settings, name="lora")


def chat(model: str, tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        **extra,
    }


async def successes(client: httpx.AsyncClient, engines: list[Engine]) -> list[float]:
    """Each engine's finished requests, by its own counter."""
    counts = []
    for engine in engines:
        done = metric_sum(await scrape(client, engine.url), "vllm:request_success_total")
        assert done is not None, f"{engine.url}/metrics has no vllm:request_success_total"
        counts.append(done)
    return counts


async def workers(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, Any]]:
    listing = (await client.get(f"{url}/v1/workers")).json()
    entries = listing["workers"] if isinstance(listing, dict) else listing
    return {entry["url"]: entry for entry in entries}


async def wait_listed(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    """Until the router's /v1/models lists both adapters; each adapter's parent."""
    while True:
        models = (await client.get(f"{url}/v1/models")).json()["data"]
        parents = {entry["id"]: entry.get("parent") for entry in models}
        if {"a", "b"} <= parents.keys():
            return parents
        await trio.sleep(0.2)


async def test_adapter_requests_reach_only_the_engines_holding_them(host: EngineHost) -> None:
    engines = host.engines
    refused = [engine.output.count(ENGINE_404) for engine in engines]
    args = ("--worker", engines[0].url, "--worker", engines[1].url)
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=120) as client, open_router(*args) as router:
            parents = await wait_listed(client, router.url)
            before = await successes(client, engines)
            for index in range(6):
                body = chat("a", SHORT_TOKENS, stream=index % 2 == 1)
                answer = await client.post(f"{router.url}/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
            unknown = await client.post(
                f"{router.url}/v1/chat/completions", json=chat("zzz", SHORT_TOKENS)
            )
            await trio.sleep(0.5)  # the engines' counters catch up with the last answer
            after = await successes(client, engines)
    delta = [round(later - earlier) for earlier, later in zip(before, after, strict=True)]
    print(f"adapter a: {delta} finished per engine; parents {parents}")
    assert parents["a"] == parents["b"] == MODEL
    assert delta == [6, 0]
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert [count.count for count in refused] == [0, 0]


async def test_a_request_for_an_adapter_goes_where_a_slot_is_free(host: EngineHost) -> None:
    engines = host.engines
    args = ("--worker", engines[0].url, "--worker", engines[1].url, "--policy", "least_load")
    placed: list[str] = []
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=120) as client, open_router(*args) as router:
            await wait_listed(client, router.url)

            async def occupy(engine: Engine, model: str) -> None:
                body = chat(model, LONG_TOKENS)
                answer = await client.post(f"{engine.url}/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text

            async with trio.open_nursery() as nursery:
                # Sent to the engines directly: the router knows them only by reading
                # the engines' own gauges.
                nursery.start_soon(occupy, engines[0], "a")
                nursery.start_soon(occupy, engines[1], MODEL)
                while True:
                    seen = await workers(client, router.url)
                    slots = seen[engines[0].url].get("adapter_slots") or {}
                    loads = [seen[engine.url].get("engine_load") for engine in engines]
                    if slots.get("running") == ["a"] and all(
                        isinstance(load, dict) and load.get("requests") == 1 for load in loads
                    ):
                        break
                    await trio.sleep(0.2)
                before = await successes(client, engines)
                for _ in range(4):
                    body = chat("b", SHORT_TOKENS)
                    answer = await client.post(f"{router.url}/v1/chat/completions", json=body)
                    assert answer.status_code == 200, answer.text
                    placed.append(answer.headers["x-router-worker"])
                after = await successes(client, engines)
                nursery.cancel_scope.cancel()
    delta = [round(later - earlier) for earlier, later in zip(before, after, strict=True)]
    print(f"adapter b beside a running a: placed on {placed}, finished per engine {delta}")
    assert placed == [engines[1].url] * 4
    assert delta == [0, 4]


async def test_an_engine_that_unloaded_an_adapter_is_a_routing_miss_not_a_fault(
    host: EngineHost,
) -> None:
    engines = host.engines
    refused = [engine.output.count(ENGINE_404) for engine in engines]
    args = ("--worker", engines[0].url, "--worker", engines[1].url, "--policy", "round_robin")
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=120) as client, open_router(*args) as router:
            await wait_listed(client, router.url)
            unloaded = await client.post(
                f"{engines[0].url}/v1/unload_lora_adapter", json={"lora_name": "b"}
            )
            assert unloaded.status_code == 200, unloaded.text
            before = await successes(client, engines)
            for _ in range(6):
                answer = await client.post(
                    f"{router.url}/v1/chat/completions", json=chat("b", SHORT_TOKENS)
                )
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-router-worker"] == engines[1].url
            await trio.sleep(0.5)
            after = await successes(client, engines)
            samples = await scrape(client, router.url)
            breaker = (await workers(client, router.url))[engines[0].url].get("breaker") or {}
    delta = [round(later - earlier) for earlier, later in zip(before, after, strict=True)]
    misses = metric_sum(samples, "router_adapter_misses_total")
    print(f"b unloaded from engine 0: 404s {[c.count for c in refused]}, finished {delta}")
    assert [count.count for count in refused] == [1, 0]
    assert delta == [0, 6]
    assert misses == 1
    assert breaker.get("consecutive_faults", 0) == 0

"""`kv_aware` on chat as an operator starts it, without `--kv-tokenizer`, on two real vLLM
engines: the token ids from the engine's model directory (read here: the engines run on
this host) and from the engines' own `/tokenize` (`--kv-token-sources engine`, as for a
router that cannot read the engines' files). Judged by the engines' own counters:

- six conversations the router never saw, two turns each played on an engine directly,
  then their third turn through the router: at least 5 of 6 reach the engine holding them;
- a multi-turn chat workload (seven conversations, four turns, two at a time) keeps at
  least 15 points more of its prompt tokens cached (the engines' prefix-cache hits over
  their queries) through `kv_aware` than through round robin.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trio

from conformance.engines import Engine, EngineSettings
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import kv_events_engine, metric_sum, open_router, scrape

MODEL = "tiny"
BLOCK = 32
SYSTEM = "You are the router's assistant; answer in one short line. " * 6
TURNS = 4
CONVERSATIONS = 7
ANSWER_TOKENS = 8


def kv_engine() -> EngineSettings:
    return kv_events_engine(
        MODEL,
        BLOCK,
        extra_args=("--override-generation-config", '{"temperature": 0.0}'),
        # /reset_prefix_cache, so each run starts from empty caches.
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    yield from host_engines([kv_engine(), kv_engine()], name="kv-token-sources")


def question(conversation: int, turn: int) -> str:
    return f"Conversation {conversation}, question {turn}: " + "tell me why the sky is blue. " * 4


async def flush(client: httpx.AsyncClient, engines: list[Engine]) -> None:
    for engine in engines:
        reset = await client.post(f"{engine.url}/reset_prefix_cache")
        assert reset.status_code == 200, reset.text


async def hit_counters(client: httpx.AsyncClient, engines: list[Engine]) -> tuple[float, float]:
    """The fleet's prefix-cache queries and hits, in tokens."""
    queries = hits = 0.0
    for engine in engines:
        samples = await scrape(client, engine.url)
        queries += metric_sum(samples, "vllm:prefix_cache_queries_total") or 0.0
        hits += metric_sum(samples, "vllm:prefix_cache_hits_total") or 0.0
    return queries, hits


async def turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]]
) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS}
    answer = await client.post(f"{url}/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    messages.append(
        {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}
    )
    return answer


async def wait_ready(client: httpx.AsyncClient, url: str, source: str) -> None:
    """Until the router subscribed to both engines and decided its token source."""
    while True:
        samples = await scrape(client, url)
        views = metric_sum(samples, "router_kv_index_views", model=MODEL, state="known")
        chosen = metric_sum(samples, "router_kv_aware_token_source", model=MODEL, source=source)
        if views == 2 and chosen == 1:
            return
        await trio.sleep(0.2)


SOURCES = {"model_dir": (), "engine": ("--kv-token-sources", "engine")}


@pytest.mark.parametrize("source", list(SOURCES))
async def test_conversations_the_router_never_saw_go_back_to_their_engine(
    host: EngineHost, source: str
) -> None:
    engines = host.engines
    args = ("--worker", engines[0].url, "--worker", engines[1].url, "--policy", "kv_aware")
    with trio.fail_after(600):
        async with httpx.AsyncClient(timeout=120) as client:
            await flush(client, engines)
            conversations: list[tuple[int, list[dict[str, str]]]] = []
            for index in range(6):
                home = index % 2
                messages = [{"role": "system", "content": SYSTEM + f" (#{index})"}]
                for number in range(2):
                    messages.append({"role": "user", "content": question(index, number)})
                    await turn(client, engines[home].url, messages)
                conversations.append((home, messages))
            async with open_router(*args, *SOURCES[source]) as router:
                await wait_ready(client, router.url, source)
                placed = []
                for index, (home, messages) in enumerate(conversations):
                    messages.append({"role": "user", "content": question(index, 2)})
                    answer = await turn(client, router.url, messages)
                    placed.append(answer.headers["x-router-worker"] == engines[home].url)
                samples = await scrape(client, router.url)
    asked = metric_sum(samples, "router_kv_aware_engine_tokenize_total", outcome="ok") or 0
    print(f"{source}: {sum(placed)} of 6 on the engine holding them, {asked:.0f} asks of /tokenize")
    assert sum(placed) >= 5, placed
    assert asked == (6 if source == "engine" else 0)


async def play(client: httpx.AsyncClient, url: str) -> None:
    """Seven conversations, four turns each, two conversations at a time."""
    queue = list(range(CONVERSATIONS))

    async def user() -> None:
        while queue:
            index = queue.pop(0)
            messages = [{"role": "system", "content": SYSTEM}]
            for number in range(TURNS):
                messages.append({"role": "user", "content": question(index, number)})
                await turn(client, url, messages)

    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(user)


async def test_kv_aware_without_the_flag_keeps_15_points_more_cached_than_round_robin(
    host: EngineHost,
) -> None:
    engines = host.engines
    workers = ("--worker", engines[0].url, "--worker", engines[1].url)
    rates: dict[str, float] = {}
    contenders = {
        "round_robin": (None, ("--policy", "round_robin")),
        "kv_aware, model dir": ("model_dir", ("--policy", "kv_aware")),
        "kv_aware, engine /tokenize": ("engine", ("--policy", "kv_aware", *SOURCES["engine"])),
    }
    with trio.fail_after(900):
        async with httpx.AsyncClient(timeout=120) as client:
            for name, (source, flags) in contenders.items():
                await flush(client, engines)
                async with open_router(*workers, *flags) as router:
                    if source is not None:
                        await wait_ready(client, router.url, source)
                    queries, hits = await hit_counters(client, engines)
                    await play(client, router.url)
                    await trio.sleep(0.5)  # the counters catch up with the last request
                    after_queries, after_hits = await hit_counters(client, engines)
                rates[name] = (after_hits - hits) / (after_queries - queries)
    print(", ".join(f"{name} {rate:.1%}" for name, rate in rates.items()))
    assert rates["kv_aware, model dir"] >= rates["round_robin"] + 0.15, rates
    assert rates["kv_aware, engine /tokenize"] >= rates["round_robin"] + 0.15, rates

"""`kv_aware` through a real router in front of three fake workers that publish their
prefix caches' KV events over ZMQ: the engines' own view routes, survives a router
restart through the replay sockets, and a publisher that dies stops counting as a hit."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.cli.serve import RunningRouter
from router.fake_worker.kv_publisher import KvEventPublisher, serve_kv_publisher
from router.fake_worker.prefix_cache import BLOCK_TOKENS, PrefixCache
from router.fake_worker.settings import KvPublisherSettings
from router.fleet.records import EventEndpoint
from router.prompts.tokenizer import HfTokenizer
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.model_dir import write_model
from tests.support.router_instance import open_router

GUARD_S = 30
MODEL = "fake-model"


def prompt(first: int, blocks: int, tail: int = 0) -> list[int]:
    """Token ids: `blocks` full blocks from `first`, then `tail` ids of a tail of its own."""
    return list(range(first, first + blocks * BLOCK_TOKENS)) + [7] * tail


@asynccontextmanager
async def open_publishers(
    fleet: list[FakeWorkerHandle],
) -> AsyncIterator[tuple[list[KvEventPublisher], list[trio.CancelScope]]]:
    """A real ZMQ publisher (PUB + replay ROUTER on loopback) on every worker's cache;
    a publisher's scope cancelled is an engine whose publisher died."""
    publishers: list[KvEventPublisher] = []
    scopes: list[trio.CancelScope] = []
    async with trio.open_nursery() as nursery:
        for handle in fleet:
            cache = handle.worker.prefix_cache
            assert cache is not None
            publisher = KvEventPublisher(
                KvPublisherSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            )
            scope = trio.CancelScope()

            async def run(
                publisher: KvEventPublisher = publisher,
                scope: trio.CancelScope = scope,
                cache: PrefixCache = cache,
                *,
                task_status: trio.TaskStatus[KvEventPublisher] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    await serve_kv_publisher(cache, publisher, task_status=task_status)

            await nursery.start(run)
            # As the command does: `/kv_event_sources` lists them (with `kv_events` set).
            handle.worker.kv_endpoints = (publisher.endpoint, publisher.replay_endpoint)
            publishers.append(publisher)
            scopes.append(scope)
        yield publishers, scopes
        nursery.cancel_scope.cancel()


def announce(
    router: RunningRouter, fleet: list[FakeWorkerHandle], pubs: list[KvEventPublisher]
) -> None:
    """What engine facts learn from vLLM's `/kv_event_sources`: each worker's publisher
    on its record."""
    for handle, publisher in zip(fleet, pubs, strict=True):
        worker = next(w for w in router.fleet.workers() if w.url == handle.url)
        endpoint = EventEndpoint(0, publisher.endpoint, publisher.replay_endpoint)
        router.fleet.upsert(dataclasses.replace(worker.record, kv_event_sources=(endpoint,)))


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = (await client.get("/metrics")).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def wait_views(client: httpx.AsyncClient, known: int, unknown: int = 0) -> None:
    async def views() -> tuple[float, float]:
        samples = await scrape(client)
        return (
            samples.get(("router_kv_index_views", (("model", MODEL), ("state", "known"))), 0),
            samples.get(("router_kv_index_views", (("model", MODEL), ("state", "unknown"))), 0),
        )

    while await views() != (known, unknown):  # noqa: ASYNC110 - a scrape, not an event
        await trio.sleep(0.02)


async def send(client: httpx.AsyncClient, ids: list[int]) -> httpx.Response:
    response = await client.post(
        "/generate",
        json={"model": MODEL, "input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
    )
    assert response.status_code == 200, response.text
    return response


async def generate(client: httpx.AsyncClient, ids: list[int]) -> str:
    """Through the router: the worker that served it."""
    return (await send(client, ids)).headers["x-router-worker"]


def dispatches(fleet: list[FakeWorkerHandle]) -> list[int]:
    return [handle.worker.routing.dispatches for handle in fleet]


async def wait_applied(client: httpx.AsyncClient, pubs: list[KvEventPublisher]) -> None:
    """Until the router applied as many batches as the publishers sent."""
    sent = sum(p.published for p in pubs)

    async def applied() -> float:
        return (await scrape(client)).get(("router_kv_events_batches_total", ()), 0)

    while await applied() < sent:  # noqa: ASYNC110 - a scrape, not an event
        await trio.sleep(0.02)


async def test_the_engines_events_route_survive_a_router_restart_and_a_dead_publisher() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(3, cache_tokens=100_000) as fleet,
            open_publishers(fleet) as (pubs, scopes),
        ):
            urls = [handle.url for handle in fleet]
            # The third worker already holds a prefix the router never sent it (sent to
            # the worker directly, as another router would): only its events say so.
            warm = prompt(10_000, 8)
            async with open_router(urls, policy="kv_aware") as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    announce(router, fleet, pubs)
                    await wait_views(client, known=3)
                    async with httpx.AsyncClient(base_url=fleet[2].url) as elsewhere:
                        await send(elsewhere, warm)
                    fleet[2].worker.routing.reset()
                    await wait_applied(client, pubs)
                    served = [await generate(client, warm + [n] * 5) for n in range(4)]
                    assert set(served) == {router_id(router, fleet[2])}
                    assert dispatches(fleet) == [0, 0, 4]

                    # A new conversation lands somewhere, then follows its own blocks:
                    # as a completions prompt of token ids too.
                    convo = prompt(20_000, 10)
                    first = await generate(client, convo)
                    holder = next(h for h in fleet if router_id(router, h) == first)
                    await wait_applied(client, pubs)
                    for turn in range(3):
                        response = await client.post(
                            "/v1/completions",
                            json={"model": MODEL, "prompt": convo + [turn] * 20, "max_tokens": 2},
                        )
                        assert response.status_code == 200
                        assert response.headers["x-router-worker"] == first
                    samples = await scrape(client)
                    assert (
                        samples[
                            (
                                "router_kv_aware_picks_total",
                                (("reason", "match"), ("role", "mixed")),
                            )
                        ]
                        >= 7
                    )
                    # Chat: the router does not render the engine's chat template: load places it.
                    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
                    samples = await scrape(client)
                    assert (
                        samples[
                            (
                                "router_kv_aware_no_prediction_total",
                                (("reason", "chat_template"), ("role", "mixed")),
                            )
                        ]
                        == 1
                    )
            before = dispatches(fleet)

            # A new router process: empty index, no pending blocks. The replay sockets
            # rebuild every view, so the old conversation's next turn goes to its holder.
            async with open_router(urls, policy="kv_aware") as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    announce(router, fleet, pubs)
                    await wait_views(client, known=3)
                    assert await generate(client, convo + [99] * 20) == router_id(router, holder)
                    after = dispatches(fleet)
                    assert [a - b for a, b in zip(after, before, strict=True)] == [
                        1 if h is holder else 0 for h in fleet
                    ]
                    samples = await scrape(client)
                    assert samples[("router_kv_events_replays_total", ())] >= 3

                    # The holder's publisher dies: its view is unknown, never a hit.
                    scopes[fleet.index(holder)].cancel()
                    await wait_views(client, known=2, unknown=1)
                    again = await generate(client, convo + [98] * 20)
                    samples = await scrape(client)
                    assert (
                        samples[("router_kv_aware_unknown_candidates_total", (("role", "mixed"),))]
                        >= 1
                    )
                    assert samples[("router_kv_events_disconnects_total", ())] >= 1
                    # Placed by load: the only match of this router is the turn before.
                    assert again in {router_id(router, h) for h in fleet}
                    assert (
                        samples[
                            (
                                "router_kv_aware_picks_total",
                                (("reason", "match"), ("role", "mixed")),
                            )
                        ]
                        == 1
                    )


def router_id(router: RunningRouter, handle: FakeWorkerHandle) -> str:
    return next(w.id for w in router.fleet.workers() if w.url == handle.url)


async def test_fakes_counting_in_a_models_tokens_route_chat_as_engines_would(
    tmp_path: Path,
) -> None:
    """Fakes with `--tokenizer` (a real tokenizer.json and chat template) publish blocks of
    the token ids a vLLM engine would compute, and a router with the same `--kv-tokenizer`
    sends a chat conversation to the fake whose cache holds it: kv_aware on text at fleet
    scale, with no engine. The router's predicted hits are the fake's cached tokens."""
    model = str(write_model(tmp_path / "model"))
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "you are a router " * 12},
            {"role": "user", "content": "tell me about the cache " * 8},
        ],
        "max_tokens": 2,
    }
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(2, cache_tokens=100_000, tokenizer=model) as fleet,
            open_publishers(fleet) as (pubs, _),
        ):
            async with httpx.AsyncClient(base_url=fleet[1].url) as direct:
                warmed = await direct.post("/v1/chat/completions", json=body)
            assert warmed.status_code == 200, warmed.text
            expected = HfTokenizer(model).chat_tokens(body)
            assert warmed.json()["usage"]["prompt_tokens"] == len(expected)
            urls = [handle.url for handle in fleet]
            async with open_router(urls, policy="kv_aware", kv_tokenizer=model) as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    announce(router, fleet, pubs)
                    await wait_views(client, known=2)
                    for _ in range(3):
                        answer = await client.post("/v1/chat/completions", json=body)
                        assert answer.headers["x-router-worker"] == fleet[1].url
                    # A Messages block whose type is not a name: no prediction, not a 500.
                    odd = {**body, "messages": [{"role": "user", "content": [{"type": []}]}]}
                    answer = await client.post("/v1/messages", json=odd)
                    assert answer.status_code != 500, answer.text
                    samples = await scrape(client)
    unpredicted = (("reason", "chat_template"), ("role", "mixed"))
    assert samples[("router_kv_aware_no_prediction_total", unpredicted)] == 1
    # The unpredicted one went to either fake (by load, in turn): the chat to fleet[1].
    assert sum(dispatches(fleet)) == 5 and dispatches(fleet)[1] >= 4
    hits = samples[("router_kv_aware_predicted_hit_tokens_total", (("role", "mixed"),))]
    cached = fleet[1].worker.routing.loads[0].cached_tokens
    assert hits == cached == 3 * ((len(expected) - 1) // BLOCK_TOKENS * BLOCK_TOKENS)


@pytest.mark.parametrize("source", ["tokenizer", "model_dir", "engine"])
async def test_chat_routes_by_the_engines_events_from_every_token_source(
    tmp_path: Path, source: str
) -> None:
    """The same chat routing without `--kv-tokenizer`: the engine's model directory read
    here, or the engine's own /tokenize asked per request (`--kv-token-sources engine`)."""
    model = str(write_model(tmp_path / "model"))
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "you are a router " * 12},
            {"role": "user", "content": "tell me about the cache " * 8},
        ],
        "max_tokens": 2,
    }
    flags: dict[str, object] = {
        "tokenizer": {"kv_tokenizer": model},
        "model_dir": {},
        "engine": {"kv_token_sources": "engine"},
    }[source]
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(
                2, engine="vllm", cache_tokens=100_000, tokenizer=model, kv_events=True
            ) as fleet,
            open_publishers(fleet),
        ):
            async with httpx.AsyncClient(base_url=fleet[1].url) as direct:
                warmed = await direct.post("/v1/chat/completions", json=body)
            assert warmed.status_code == 200, warmed.text
            urls = [handle.url for handle in fleet]
            async with open_router(urls, policy="kv_aware", **flags) as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    # vLLM fakes: the router learns the publishers from /kv_event_sources.
                    await wait_views(client, known=2)
                    label = (("model", MODEL), ("source", source))
                    while (await scrape(client)).get(("router_kv_aware_token_source", label)) != 1:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                    for _ in range(3):
                        answer = await client.post("/v1/chat/completions", json=body)
                        assert answer.headers["x-router-worker"] == fleet[1].url
                    samples = await scrape(client)
    chats = [handle.worker.routing.paths.get("/v1/chat/completions", 0) for handle in fleet]
    assert chats == [0, 4]  # the warm-up and the three through the router
    asked = samples[("router_kv_aware_engine_tokenize_total", (("outcome", "ok"),))]
    assert asked == (3 if source == "engine" else 0)
    assert samples[("router_kv_aware_predictions_total", (("role", "mixed"),))] == 3

"""The fake worker's KV events, read by the router's own subscription over real ZMQ: its
prefix cache's stores, evictions and flushes arrive as vLLM's events, and a subscriber
that starts late rebuilds the view from the replay socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import trio
import zmq

from router.engines.facts import kv_event_endpoints
from router.engines.kv_events import (
    KvEventSource,
    KvIndex,
    KvSubscription,
    SubscriptionSettings,
    ViewState,
    serve_kv_subscription,
)
from router.fake_worker.info import kv_event_sources
from router.fake_worker.kv_publisher import KvEventPublisher, serve_kv_publisher
from router.fake_worker.prefix_cache import BLOCK_TOKENS, PrefixCache, tokenize
from router.fake_worker.settings import (
    FakeWorkerSettings,
    KvPublisherSettings,
    publisher_settings,
)
from router.fleet.records import EventEndpoint
from tests.support.fake_fleet import open_fake_fleet

VIEW = ("fake", None)
# A bound on a hang, not a measure: a test takes well under a second on a quiet machine
# and up to 10 s was seen beside three engines at load 12.
GUARD_S = 40


@dataclass
class Pair:
    cache: PrefixCache
    publisher: KvEventPublisher
    index: KvIndex
    subscription: KvSubscription | None = None

    def held(self, ids: list[int]) -> int | None:
        result = self.index.match(self.index.block_keys(ids), 0.0)
        return None if VIEW in result.unknown else result.runs.get(VIEW)

    async def caught_up(self) -> None:
        assert self.subscription is not None
        subscription = self.subscription
        last = self.publisher.next_seq - 1
        await subscription.wait_until(lambda: subscription.statistics().last_seq >= last)

    async def subscribe(
        self, nursery: trio.Nursery, zmq_context: zmq.Context[zmq.Socket[bytes]]
    ) -> None:
        source = KvEventSource(
            "fake", None, self.publisher.endpoint, self.publisher.replay_endpoint
        )
        self.subscription = KvSubscription(
            source, self.index, SubscriptionSettings(replay_timeout_s=1.0), context=zmq_context
        )
        await nursery.start(serve_kv_subscription, self.subscription)
        subscription = self.subscription
        await subscription.wait_until(lambda: subscription.statistics().connects >= 1)
        await self.caught_up()


@asynccontextmanager
async def open_pair(
    zmq_context: zmq.Context[zmq.Socket[bytes]], capacity_tokens: int = 10_000
) -> AsyncIterator[tuple[Pair, trio.Nursery]]:
    cache = PrefixCache(capacity_tokens)
    publisher = KvEventPublisher(
        KvPublisherSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"), zmq_context
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_kv_publisher, cache, publisher)
        yield Pair(cache, publisher, KvIndex()), nursery
        nursery.cancel_scope.cancel()


def ids(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BLOCK_TOKENS))


def serve(cache: PrefixCache, prompt: list[int]) -> None:
    cache.serve(tokenize("generate", {"input_ids": prompt}))


async def test_stores_evictions_and_flushes_arrive_as_the_engines_events(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_pair(zmq_context, capacity_tokens=6 * BLOCK_TOKENS) as (pair, nursery):
            await pair.subscribe(nursery, zmq_context)
            serve(pair.cache, ids(0, 4))
            await pair.caught_up()
            assert pair.index.view_state(VIEW) is ViewState.KNOWN
            assert pair.held([*ids(0, 4), 1, 2, 3]) == 4
            # A longer prompt of the same prefix stores only its new blocks, chained.
            serve(pair.cache, ids(0, 5))
            await pair.caught_up()
            assert pair.held(ids(0, 5)) == 5
            # Another prompt overflows the 6-block cache: the oldest tail goes.
            serve(pair.cache, ids(1000, 3))
            await pair.caught_up()
            assert pair.held(ids(1000, 3)) == 3
            assert pair.held(ids(0, 5)) == 3
            pair.cache.clear()
            await pair.caught_up()
            assert pair.held(ids(1000, 3)) == 0
            assert pair.subscription is not None
            stats = pair.subscription.statistics()
            assert stats.events == {"BlockStored": 3, "BlockRemoved": 1, "AllBlocksCleared": 1}
            assert stats.decode_errors == 0 and stats.gaps == 0


async def test_text_prompts_publish_their_token_ids(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    text = "abcd" * BLOCK_TOKENS * 2
    with trio.fail_after(GUARD_S):
        async with open_pair(zmq_context) as (pair, nursery):
            await pair.subscribe(nursery, zmq_context)
            pair.cache.serve(tokenize("completions", {"prompt": text}))
            await pair.caught_up()
            token = int.from_bytes(b"abcd", "little")
            assert pair.held([token] * BLOCK_TOKENS * 2) == 2


async def test_a_late_subscriber_rebuilds_the_view_from_the_replay_socket(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_pair(zmq_context) as (pair, nursery):
            serve(pair.cache, ids(0, 3))
            serve(pair.cache, ids(500, 2))
            # Nobody listened to those: only the replay buffer has them.
            await pair.subscribe(nursery, zmq_context)
            assert pair.index.view_state(VIEW) is ViewState.KNOWN
            assert pair.held(ids(0, 3)) == 3 and pair.held(ids(500, 2)) == 2
            assert pair.publisher.replays >= 1


def test_the_flag_binds_pub_on_the_port_and_replay_beside_it_and_needs_the_cache() -> None:
    settings = FakeWorkerSettings(host="::1", cache_tokens=1024, kv_events_port=5557)
    assert publisher_settings(settings) == KvPublisherSettings(
        "tcp://[::1]:5557", "tcp://[::1]:5558"
    )
    with pytest.raises(ValueError, match="needs a prefix cache"):
        FakeWorkerSettings(kv_events_port=5557)
    with pytest.raises(ValueError, match="kv_events_port"):
        FakeWorkerSettings(cache_tokens=1024, kv_events_port=65535)


@pytest.mark.parametrize(
    ("host", "listed_host"), [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "10.1.2.3")]
)
def test_the_fake_lists_its_publisher_as_vllm_does_and_the_router_reads_it(
    host: str, listed_host: str
) -> None:
    settings = FakeWorkerSettings(engine="vllm", host=host, cache_tokens=1024, kv_events_port=5557)
    # The router's own reader of `/kv_event_sources`, with the worker's URL as discovery
    # gave it: a `*` host becomes that URL's host.
    endpoints = kv_event_endpoints(kv_event_sources(settings), f"http://{listed_host}:8000")
    assert endpoints == (
        EventEndpoint(0, f"tcp://{listed_host}:5557", f"tcp://{listed_host}:5558", ""),
    )
    assert kv_event_sources(FakeWorkerSettings(engine="vllm")) == {}


async def test_the_fake_serves_the_listing_on_its_http_port() -> None:
    settings = FakeWorkerSettings(engine="vllm", cache_tokens=1024, kv_events_port=5557)
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([settings]) as (worker,):
            async with httpx.AsyncClient(base_url=worker.url) as client:
                answer = await client.get("/kv_event_sources")
    assert answer.status_code == 200
    assert answer.json()["0"]["endpoint"] == "tcp://127.0.0.1:5557"
    assert answer.json()["0"]["replay_endpoint"] == "tcp://127.0.0.1:5558"

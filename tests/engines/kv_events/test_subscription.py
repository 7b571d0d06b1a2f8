"""A subscription against a real ZMQ publisher on loopback, framed as vLLM frames it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import zmq

from router.engines.kv_events import (
    IndexSettings,
    KvEventSource,
    KvIndex,
    KvSubscription,
    SubscriptionSettings,
    ViewId,
    ViewState,
    serve_kv_subscription,
)
from tests.engines.kv_events.publisher import TestPublisher, open_test_publisher
from tests.engines.kv_events.wire import Form, blocks, cleared, encode, removed, stored

BS = 4
VIEW: ViewId = ("w1", 0)
SETTINGS = SubscriptionSettings(replay_timeout_s=0.3, retry_initial_s=0.05, retry_max_s=0.2)
# A bound on a hang, not a measure: a test takes well under a second on a quiet machine
# and up to 10 s was seen beside three engines at load 12.
GUARD_S = 40


@dataclass
class Running:
    publisher: TestPublisher
    index: KvIndex
    subscription: KvSubscription
    nursery: trio.Nursery

    def held(self, first_token: int, count: int) -> int | None:
        """Blocks of the prompt the view holds; None when the view is unknown."""
        keys = self.index.block_keys(blocks(first_token, count, BS))
        result = self.index.match(keys, now=0.0)
        return None if VIEW in result.unknown else result.runs[VIEW]

    def known(self) -> bool:
        return self.index.view_state(VIEW) is ViewState.KNOWN

    async def live(self) -> None:
        """Until the subscription is live on the publisher (no sleeping through ZMQ's
        slow-joiner window: the XPUB reports the subscription) and caught up, its
        catch-up replay after the connect included."""
        await self.publisher.wait_subscribed()
        await self.until(lambda: self.subscription.statistics().connects >= 1)
        seq = self.publisher.next_seq - 1
        await self.subscription.wait_until(lambda: self.subscription.statistics().last_seq >= seq)

    async def until(self, condition: Callable[[], bool]) -> None:
        await self.subscription.wait_until(condition)

    async def applied(self, seq: int) -> None:
        await self.subscription.wait_until(lambda: self.subscription.statistics().last_seq >= seq)


@asynccontextmanager
async def open_running(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    *,
    buffer_steps: int = 10_000,
    before: Callable[[TestPublisher], None] | None = None,
    form: Form = Form.MAP,
    replay_topic: bool = True,
) -> AsyncIterator[Running]:
    async with open_test_publisher(
        zmq_context, buffer_steps=buffer_steps, replay_topic=replay_topic
    ) as publisher:
        if before is not None:
            before(publisher)
        index = KvIndex(IndexSettings())
        source = KvEventSource(
            worker_id=VIEW[0],
            dp_rank=VIEW[1],
            endpoint=publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
        )
        subscription = KvSubscription(source, index, SETTINGS, context=zmq_context)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_kv_subscription, subscription)
            yield Running(publisher, index, subscription, nursery)
            nursery.cancel_scope.cancel()


def known(index: KvIndex, view: ViewId) -> Callable[[], bool]:
    return lambda: index.view_state(view) is ViewState.KNOWN


def store_payload(first_token: int, count: int, hashes: list[int], parent: int | None) -> bytes:
    return encode([stored(hashes, parent, blocks(first_token, count, BS), BS)])


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.32", "without-topic"])
async def test_start_replays_the_buffer_then_live_events_flow(
    zmq_context: zmq.Context[zmq.Socket[bytes]], replay_topic: bool
) -> None:
    """The replay answers framed as vLLM 0.32 frames them (a topic frame before the seq)
    and as earlier releases did (none): both rebuild the view, with no decode error."""

    def warm(publisher: TestPublisher) -> None:
        # Published before the router existed: only the replay buffer has it.
        publisher.publish(store_payload(0, 2, [1, 2], None))
        publisher.publish(encode([stored([3], 2, blocks(8, 1, BS), BS)], Form.ARRAY))

    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context, before=warm, replay_topic=replay_topic) as run:
            await run.until(run.known)
            assert run.held(0, 3) == 3
            await run.live()
            run.publisher.publish(encode([removed([3])], Form.MAP_EVENTS))
            await run.applied(2)
            assert run.held(0, 3) == 2
            stats = run.subscription.statistics()
            assert stats.events == {"BlockStored": 2, "BlockRemoved": 1, "AllBlocksCleared": 0}
            assert stats.batches == 3
            assert stats.gaps == stats.restarts == stats.decode_errors == 0
            assert run.publisher.replay_requests[0] == 0  # the rebuild asks from seq 0
            assert stats.replays == len(run.publisher.replay_requests)


async def test_a_gap_is_replayed_in_order(zmq_context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context) as run:
            await run.until(run.known)
            await run.live()
            run.publisher.publish(store_payload(0, 1, [1], None))
            await run.applied(0)
            requests = len(run.publisher.replay_requests)
            run.publisher.publish(encode([stored([2], 1, blocks(4, 1, BS), BS)]), live=False)
            run.publisher.publish(encode([stored([3], 2, blocks(8, 1, BS), BS)]), live=False)
            seq = run.publisher.publish(encode([stored([4], 3, blocks(12, 1, BS), BS)]))
            await run.applied(seq)
            assert run.held(0, 4) == 4  # the chain only resolves if 1 and 2 came in order
            assert run.known()
            stats = run.subscription.statistics()
            assert stats.gaps == 1
            assert run.publisher.replay_requests[requests:] == [1]
            assert stats.replayed_batches >= 2


async def test_an_engine_restart_rebuilds_the_view(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context) as run:
            await run.until(run.known)
            await run.live()
            run.publisher.publish(store_payload(0, 2, [1, 2], None))
            run.publisher.publish(store_payload(100, 1, [9], None))
            await run.applied(1)
            assert run.held(0, 2) == 2
            run.publisher.restart()  # a new process: seq from 0, an empty cache
            run.publisher.publish(store_payload(200, 1, [1], None))
            await run.until(lambda: run.subscription.statistics().restarts == 1)
            await run.until(lambda: run.known() and run.held(200, 1) == 1)
            assert run.held(0, 2) == 0  # the old process's blocks are gone
            assert run.held(100, 1) == 0
            assert run.publisher.replay_requests[-1] == 0


async def test_a_gap_the_buffer_lost_is_unknown_until_cleared(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context, buffer_steps=2) as run:
            await run.until(run.known)
            await run.live()
            run.publisher.publish(store_payload(0, 1, [1], None))
            await run.applied(0)
            for n in range(3):  # lost on the wire, and pushed out of the buffer
                run.publisher.publish(store_payload(50 + 10 * n, 1, [50 + n], None), live=False)
            seq = run.publisher.publish(store_payload(300, 1, [7], None))
            await run.applied(seq)
            assert not run.known()
            assert run.held(0, 1) is None  # reported as unknown, not as zero
            assert run.index.view_reason(VIEW) == "replay buffer lost seqs 1..2"
            stats = run.subscription.statistics()
            assert (stats.gaps, stats.unknown_views) == (1, 1)
            # The engine clears its cache: the view is whole again from there.
            seq = run.publisher.publish(
                encode([cleared(), stored([8], None, blocks(400, 1, BS), BS)])
            )
            await run.applied(seq)
            assert run.known()
            assert (run.held(400, 1), run.held(300, 1), run.held(0, 1)) == (1, 0, 0)


async def test_a_router_start_after_the_buffer_wrapped_is_unknown(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    def old(publisher: TestPublisher) -> None:
        for n in range(3):
            publisher.publish(store_payload(10 * n, 1, [n], None))

    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context, buffer_steps=2, before=old) as run:
            await run.until(lambda: run.subscription.statistics().replayed_batches == 2)
            assert not run.known()
            assert run.index.view_reason(VIEW) == "replay buffer no longer reaches seq 0"


async def test_garbage_is_counted_logged_once_and_the_subscription_goes_on(
    zmq_context: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.engines.kv_events")
    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context) as run:
            await run.until(run.known)
            await run.live()
            run.publisher.send_raw([b"one frame"])
            run.publisher.send_raw([b"", b"short", b"x"])
            run.publisher.publish(b"\xc1 not msgpack")  # a readable seq, an unreadable batch
            await run.until(lambda: run.subscription.statistics().decode_errors == 3)
            assert not run.known()  # that batch's events are lost
            seq = run.publisher.publish(
                encode([cleared(), stored([1], None, blocks(0, 1, BS), BS)])
            )
            await run.applied(seq)
            assert run.known()
            assert run.held(0, 1) == 1
            stats = run.subscription.statistics()
            assert (stats.decode_errors, stats.gaps, stats.batches) == (3, 0, 1)
    warnings = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(warnings) == 1


async def test_unknown_event_types_are_counted_not_fatal(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    import msgspec

    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context) as run:
            await run.until(run.known)
            await run.live()
            payload = msgspec.msgpack.encode(
                {"ts": 1.0, "events": [{"type": "BlockPinned"}, {"type": "AllBlocksCleared"}]}
            )
            seq = run.publisher.publish(payload)
            await run.applied(seq)
            stats = run.subscription.statistics()
            assert (stats.unknown_event_types, stats.decode_errors) == (1, 0)
            assert stats.events["AllBlocksCleared"] == 1
            assert run.known()


async def test_a_silent_replay_socket_is_unknown_then_retried(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    def silent(publisher: TestPublisher) -> None:
        publisher.replay_enabled = False
        publisher.publish(store_payload(0, 2, [1, 2], None))

    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context, before=silent) as run:
            await run.until(lambda: run.subscription.statistics().replay_failures >= 1)
            assert run.held(0, 2) is None
            run.publisher.replay_enabled = True
            await run.until(run.known)
            assert run.held(0, 2) == 2
            assert run.publisher.replay_requests[-1] == 0


async def _term(zmq_context: zmq.Context[zmq.Socket[bytes]]) -> None:
    # term() returns only once every socket of the zmq_context is closed.
    await trio.to_thread.run_sync(zmq_context.term, abandon_on_cancel=True)


async def test_cancellation_closes_every_socket(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_test_publisher(zmq_context) as publisher:
            source = KvEventSource("w1", 0, publisher.endpoint, publisher.replay_endpoint)
            subscription = KvSubscription(source, KvIndex(), SETTINGS, context=zmq_context)
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_kv_subscription, subscription)
                await publisher.wait_subscribed()
                nursery.cancel_scope.cancel()
            await publisher.wait_unsubscribed()  # the SUB's connection went away
        await _term(zmq_context)


async def test_cancellation_during_a_replay_closes_its_socket(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_test_publisher(zmq_context) as publisher:
            publisher.replay_enabled = False
            source = KvEventSource("w1", 0, publisher.endpoint, publisher.replay_endpoint)
            subscription = KvSubscription(
                source, KvIndex(), SubscriptionSettings(replay_timeout_s=60), context=zmq_context
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_kv_subscription, subscription)
                await publisher.replay_wanted.wait()  # the replay is waiting for its answer
                nursery.cancel_scope.cancel()
        await _term(zmq_context)


async def test_a_cut_connection_is_caught_up_on_reconnect(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context) as run:
            await run.until(run.known)
            await run.live()
            run.publisher.publish(store_payload(0, 1, [1], None))
            await run.applied(0)
            run.publisher.cut()
            # Published while the subscriber is disconnected, and nothing after: only the
            # reconnect can tell the subscription to fetch them.
            run.publisher.publish(encode([stored([2], 1, blocks(4, 1, BS), BS)]), live=False)
            run.publisher.publish(encode([stored([3], 2, blocks(8, 1, BS), BS)]), live=False)
            await run.publisher.resume()
            await run.until(lambda: run.subscription.statistics().last_seq == 2)
            assert run.held(0, 3) == 3
            stats = run.subscription.statistics()
            assert (stats.reconnects, stats.gaps) == (1, 0)
            assert run.known()


async def test_each_dp_rank_is_its_own_view(zmq_context: zmq.Context[zmq.Socket[bytes]]) -> None:
    index = KvIndex()
    with trio.fail_after(GUARD_S):
        async with (
            open_test_publisher(zmq_context) as rank0,
            open_test_publisher(zmq_context) as rank1,
            trio.open_nursery() as nursery,
        ):
            rank0.publish(encode([stored([1, 2], None, blocks(0, 2, BS), BS)], dp_rank=0))
            rank1.publish(encode([stored([1], None, blocks(0, 1, BS), BS)], dp_rank=1))
            subscriptions = []
            for rank, publisher in enumerate((rank0, rank1)):
                source = KvEventSource("w", rank, publisher.endpoint, publisher.replay_endpoint)
                subscription = KvSubscription(source, index, SETTINGS, context=zmq_context)
                await nursery.start(serve_kv_subscription, subscription)
                subscriptions.append(subscription)
            for subscription in subscriptions:
                await subscription.wait_until(known(index, subscription.view))
            keys = index.block_keys(blocks(0, 2, BS))
            assert index.match(keys, now=0.0).runs == {("w", 0): 2, ("w", 1): 1}
            assert [s.statistics().rank_mismatches for s in subscriptions] == [0, 0]
            nursery.cancel_scope.cancel()


async def test_without_a_replay_socket_the_view_is_unknown_until_cleared(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_test_publisher(zmq_context) as publisher:
            index = KvIndex()
            source = KvEventSource("w1", 0, publisher.endpoint, None)
            subscription = KvSubscription(source, index, SETTINGS, context=zmq_context)
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_kv_subscription, subscription)
                await publisher.wait_subscribed()
                publisher.publish(encode([stored([1], None, blocks(0, 1, BS), BS)]))
                await subscription.wait_until(lambda: subscription.statistics().batches == 1)
                assert index.view_state(VIEW) is ViewState.UNKNOWN
                assert index.view_reason(VIEW) == "no replay endpoint: a gap cannot be repaired"
                publisher.publish(encode([cleared(), stored([1], None, blocks(0, 1, BS), BS)]))
                await subscription.wait_until(lambda: subscription.statistics().batches == 2)
                assert index.view_state(VIEW) is ViewState.KNOWN
                assert subscription.statistics().replays == 0
                nursery.cancel_scope.cancel()


async def test_a_bad_endpoint_leaves_the_view_unknown_without_crashing(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    index = KvIndex()
    source = KvEventSource("w1", 0, "tcp://no port here", None)
    subscription = KvSubscription(source, index, SETTINGS, context=zmq_context)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_kv_subscription, subscription)
            assert index.view_state(VIEW) is ViewState.UNKNOWN
            nursery.cancel_scope.cancel()
    await _term(zmq_context)


async def test_a_repaired_gap_does_not_hide_an_earlier_loss(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_running(zmq_context) as run:
            await run.until(run.known)
            await run.live()
            run.publisher.publish(b"\xc1 lost for good")  # seq 0: its events are gone
            await run.applied(0)
            run.publisher.replay_enabled = False
            run.publisher.publish(store_payload(0, 1, [1], None), live=False)
            seq = run.publisher.publish(store_payload(10, 1, [2], None))
            await run.until(lambda: run.subscription.statistics().replay_failures >= 1)
            run.publisher.replay_enabled = True
            await run.applied(seq)  # the retry fetched the gap...
            assert run.held(0, 1) is None  # ...but the undecodable batch still counts
            assert run.index.view_reason(VIEW) == "batch 0 could not be decoded"

"""Subscriptions owned by the fleet: one per worker rank while the worker is in the
fleet, from its record's endpoints or the static ports; a departed worker's view goes."""

from __future__ import annotations

import dataclasses

import trio
import zmq

from router.engines.kv_events import KvEventSource, SubscriptionSettings, ViewState
from router.engines.kv_events.fleet_views import (
    KvEvents,
    KvEventsSettings,
    KvIndexes,
    serve_kv_events,
    worker_sources,
)
from router.engines.kv_events.grpc_subscription import GrpcKvSource
from router.fleet.records import EventEndpoint, WorkerRecord
from router.fleet.registry import Fleet, Worker
from tests.engines.kv_events.publisher import open_test_publisher
from tests.engines.kv_events.wire import blocks, encode, stored
from tests.support.waiting import wait_until

BS = 4
# A bound on a hang, not a measure: a test takes well under a second on a quiet machine
# and up to 10 s was seen beside three engines at load 12.
GUARD_S = 40


def test_static_ports_give_one_source_per_rank_on_the_workers_own_host() -> None:
    settings = KvEventsSettings(port=5557, replay_port=5600)
    plain = Worker(record=WorkerRecord(id="a", url="http://10.0.0.5:8000", models=("m",)))
    assert worker_sources(plain, settings) == (
        KvEventSource("a", None, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600"),
    )
    dp = Worker(record=WorkerRecord(id="b", url="http://[fd00::1]:8000", models=("m",), dp_size=2))
    assert worker_sources(dp, KvEventsSettings(port=5557)) == (
        KvEventSource("b", 0, "tcp://[fd00::1]:5557", None),
        KvEventSource("b", 1, "tcp://[fd00::1]:5558", None),
    )
    one_rank = Worker(
        record=WorkerRecord(id="c", url="http://h:8000", models=("m",), dp_size=4, dp_rank=2)
    )
    assert worker_sources(one_rank, settings) == (
        KvEventSource("c", 2, "tcp://h:5559", "tcp://h:5602"),
    )
    assert worker_sources(plain, KvEventsSettings()) == ()


def test_a_grpc_worker_is_one_stream_of_all_its_ranks_over_its_own_connection() -> None:
    settings = KvEventsSettings(port=5557, replay_port=5558)
    plain = Worker(record=WorkerRecord(id="g", url="grpc://10.0.0.5:9000", models=("m",)))
    dp = Worker(record=WorkerRecord(id="h", url="grpc://h:9000", models=("m",), dp_size=2))
    one_rank = Worker(
        record=WorkerRecord(id="i", url="grpc://h:9000", models=("m",), dp_size=4, dp_rank=2)
    )
    # The static ZMQ ports are not the engine's over gRPC: the stream is.
    assert worker_sources(plain, settings) == (
        GrpcKvSource("g", "grpc://10.0.0.5:9000", {0: None}),
    )
    assert worker_sources(dp, KvEventsSettings()) == (
        GrpcKvSource("h", "grpc://h:9000", {0: 0, 1: 1}),
    )
    assert worker_sources(one_rank, KvEventsSettings()) == (
        GrpcKvSource("i", "grpc://h:9000", {2: 2}),
    )
    # A record that names its ZMQ publishers keeps them (their replay reaches seq 0).
    named = dataclasses.replace(
        plain.record, kv_event_sources=(EventEndpoint(0, "tcp://10.0.0.5:5557", None),)
    )
    assert worker_sources(Worker(record=named), settings) == (
        KvEventSource("g", None, "tcp://10.0.0.5:5557", None),
    )


def test_the_records_endpoints_win_over_the_static_ports() -> None:
    record = WorkerRecord(
        id="a",
        url="http://h:8000",
        models=("m",),
        dp_size=2,
        kv_event_sources=(
            EventEndpoint(0, "tcp://h:7000", "tcp://h:7100"),
            EventEndpoint(1, "tcp://h:7001", None, topic="kv"),
        ),
    )
    assert worker_sources(Worker(record=record), KvEventsSettings(port=5557)) == (
        KvEventSource("a", 0, "tcp://h:7000", "tcp://h:7100"),
        KvEventSource("a", 1, "tcp://h:7001", None, b"kv"),
    )


async def test_a_subscription_follows_the_worker_in_and_out_of_the_fleet(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(GUARD_S):
        async with open_test_publisher(zmq_context) as publisher:
            publisher.publish(encode([stored([1, 2], None, blocks(0, 2, BS), BS)]))
            fleet = Fleet()
            indexes = KvIndexes()
            events = KvEvents(
                fleet,
                indexes,
                KvEventsSettings(
                    reconcile_s=0.01, subscription=SubscriptionSettings(replay_timeout_s=1.0)
                ),
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_kv_events, events)
                record = WorkerRecord(id="w", url="http://127.0.0.1:1", models=("m",))
                fleet.upsert(record)  # no endpoints yet: nothing to subscribe to
                await trio.sleep(0.05)
                assert events.statistics().subscriptions == 0
                endpoint = EventEndpoint(0, publisher.endpoint, publisher.replay_endpoint)
                fleet.upsert(dataclasses.replace(record, kv_event_sources=(endpoint,)))
                index = indexes.for_model("m")
                await wait_until(lambda: index.view_state(("w", None)) is ViewState.KNOWN)
                keys = index.block_keys(blocks(0, 2, BS))
                assert index.match(keys, 0.0).runs[("w", None)] == 2
                assert events.statistics().subscriptions == 1
                assert events.statistics().replays >= 1
                fleet.remove("w")
                await wait_until(lambda: events.statistics().subscriptions == 0)
                # Gone with its blocks; counters of the ended subscription stay summed.
                assert index.view_state(("w", None)) is None and len(index) == 0
                assert events.statistics().replays >= 1
                await wait_until(lambda: publisher.subscribed == 0)
                nursery.cancel_scope.cancel()

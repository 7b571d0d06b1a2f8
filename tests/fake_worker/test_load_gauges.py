"""The fake's load as an engine reports it: gauges that step with a lag, another sender's
requests beside its own, and SGLang's pushed load stream on consecutive ports."""

from __future__ import annotations

import msgspec
import pytest
import trio
import zmq

from router.engines.facts import load_event_endpoints
from router.engines.load_readings import (
    load_message,
    loads_readings,
    metrics_readings,
    server_load_count,
)
from router.engines.zmq_trio import close_socket, recv_multipart, socket_fd
from router.fake_worker.engine import FakeWorker
from router.fake_worker.load_publisher import HEARTBEAT_S, serve_load_publisher
from router.fake_worker.settings import FakeWorkerSettings
from tests.fake_worker.test_engine import call


def running(worker: FakeWorker) -> list[int]:
    return [load.running for load in worker.gauge_loads()]


async def test_stepped_gauges_show_the_step_before(autojump_clock: object) -> None:
    worker = FakeWorker(FakeWorkerSettings(engine="vllm", gauge_step_ms=100))
    live = worker.routing.loads[0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.step_gauges)
        await trio.sleep(0.001)
        live.running = 3  # three requests start just after a step
        assert running(worker) == [0]
        await trio.sleep(0.1)  # the next step takes them; it shows the one before
        assert running(worker) == [0]
        await trio.sleep(0.1)
        assert running(worker) == [3]
        live.running = 0
        await trio.sleep(0.2)
        assert running(worker) == [0]
        nursery.cancel_scope.cancel()


async def test_live_gauges_without_a_step_and_another_senders_load_on_every_page() -> None:
    worker = FakeWorker(FakeWorkerSettings(engine="vllm", external_load=2))
    worker.routing.loads[0].running = 1
    assert running(worker) == [3]
    page = (await call(worker, "GET", "/metrics")).body.decode()
    assert metrics_readings(page, "vllm")[0].total == 3.0
    reply = await call(worker, "POST", "/debug/behaviour", {"external_load": 7})
    assert reply.status == 200
    sglang = FakeWorker(FakeWorkerSettings(engine="sglang", dp_size=2, external_load=4))
    body = (await call(sglang, "GET", "/v1/loads")).json()
    assert {rank: r.total for rank, r in loads_readings(body).items()} == {0: 4.0, 1: 0.0}


@pytest.mark.parametrize("value", [-1, "3", True, 1.5])
async def test_external_load_must_be_a_count(value: object) -> None:
    worker = FakeWorker(FakeWorkerSettings())
    reply = await call(worker, "POST", "/debug/behaviour", {"external_load": value})
    assert reply.status == 400 and worker.behaviour.external_load == 0


async def test_vllms_load_counts_live_with_tracking_and_says_0_without(
    autojump_clock: object,
) -> None:
    tracked = FakeWorker(
        FakeWorkerSettings(
            engine="vllm", enable_server_load_tracking=True, external_load=1, gauge_step_ms=100
        )
    )
    untracked = FakeWorker(FakeWorkerSettings(engine="vllm", external_load=1))
    for worker in (tracked, untracked):
        worker.routing.loads[0].running = 2
        worker.routing.loads[0].queued = 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracked.step_gauges)
        await trio.sleep(0.001)
        tracked.routing.loads[0].running = 5  # live at once, whatever the gauges' step
        body = (await call(tracked, "GET", "/load")).json()
        assert server_load_count(body) == 7.0 and running(tracked) == [3]
        nursery.cancel_scope.cancel()
    assert (await call(untracked, "GET", "/load")).json() == {"server_load": 0}
    sglang = FakeWorker(FakeWorkerSettings(engine="sglang"))
    assert (await call(sglang, "GET", "/load")).status == 404


def test_load_tracking_is_vllms() -> None:
    with pytest.raises(ValueError, match="enable_server_load_tracking"):
        FakeWorkerSettings(engine="sglang", enable_server_load_tracking=True)


def test_the_load_stream_is_sglang_only_and_a_step_is_not_negative() -> None:
    with pytest.raises(ValueError, match="sglang"):
        FakeWorkerSettings(engine="vllm", load_events=True)
    with pytest.raises(ValueError, match="gauge_step_ms"):
        FakeWorkerSettings(gauge_step_ms=-1)


async def test_the_pushed_stream_per_rank_on_change_and_as_a_heartbeat() -> None:
    worker = FakeWorker(FakeWorkerSettings(engine="sglang", dp_size=2, load_events=True))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            base = await nursery.start(serve_load_publisher, worker)
            # Advertised as SGLang advertises it, and read back as the router reads it.
            info = (await call(worker, "GET", "/server_info")).json()
            sources = load_event_endpoints(info, "http://127.0.0.1:1")
            assert [s.endpoint for s in sources] == [
                f"tcp://127.0.0.1:{base}",
                f"tcp://127.0.0.1:{base + 1}",
            ]
            subs = []
            for source in sources:
                sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"load")
                sub.connect(source.endpoint)
                subs.append((sub, socket_fd(sub)))
            try:
                # A late subscriber still hears each rank within a heartbeat.
                for rank, (sub, fd) in enumerate(subs):
                    frames = await recv_multipart(sub, fd)
                    stat = msgspec.msgpack.decode(frames[2])
                    assert stat[0] == "LoadStat" and stat[5] == rank
                worker.routing.loads[1].running = 5
                sub, fd = subs[1]
                started = trio.current_time()
                while True:
                    _, reading = load_message(await recv_multipart(sub, fd))
                    if reading.running == 5:
                        break
                assert trio.current_time() - started < HEARTBEAT_S  # a change goes at once
            finally:
                for sub, _ in subs:
                    close_socket(sub)
            nursery.cancel_scope.cancel()
    assert worker.load_port_base is None  # closed with its task

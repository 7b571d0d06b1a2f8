"""The engine load reader against real servers on loopback: fake engines of each kind, and
raw servers that hang, lie or answer garbage. Every failure leaves the load unknown at
once (never a stale figure, never zero), is counted, and leaves no task behind."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from router.engines.load_reader import (
    OUTCOMES,
    EngineLoads,
    LoadReaderSettings,
    LoadSource,
    serve_engine_loads,
)
from router.fake_worker.engine import FakeWorker, serve_fake_worker
from router.fake_worker.load_publisher import serve_load_publisher
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import WorkerRecord
from router.fleet.registry import Fleet, Worker
from tests.support.fake_fleet import open_fake_fleet
from tests.support.raw_upstream import Exchange, open_raw_upstream
from tests.support.waiting import wait_until

FAST = LoadReaderSettings(
    interval_s=0.05, timeout_s=0.5, silence_s=0.3, reconcile_s=0.02, server_load_interval_s=0.02
)
GUARD_S = 20


@asynccontextmanager
async def reading(
    records: list[WorkerRecord], settings: LoadReaderSettings = FAST
) -> AsyncIterator[tuple[Fleet, EngineLoads]]:
    fleet = Fleet(engine_shares=True)
    for record in records:
        fleet.upsert(record)
    loads = EngineLoads(fleet, settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_engine_loads, loads)
        yield fleet, loads
        nursery.cancel_scope.cancel()


def record(url: str, engine: str | None, **fields: object) -> WorkerRecord:
    return WorkerRecord(id=url, url=url, models=("m",), engine=engine, **fields)  # type: ignore[arg-type]


def known(worker: Worker) -> Callable[[], bool]:
    return lambda: worker.engine_share() is not None


def unknown(worker: Worker) -> Callable[[], bool]:
    return lambda: worker.engine_share() is None


@pytest.mark.parametrize(
    ("engine", "source"), [("vllm", LoadSource.METRICS), ("sglang", LoadSource.LOADS)]
)
async def test_another_senders_work_is_read_from_the_engine(engine: str, source: str) -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1, engine=engine, external_load=5) as (fake,),
            reading([record(fake.url, engine)]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(known(worker))
            assert worker.engine_share() is not None
            assert worker.engine_share()[0] == 5.0  # type: ignore[index]
            assert worker.load == 5.0
            assert loads.source_of(worker.id) == source
            # The other sender's work ends: the next reading says so.
            fake.worker.behaviour.external_load = 0
            await wait_until(lambda: worker.load == 0.0)
            assert loads.reads[(source, "ok")] >= 2


async def test_an_engine_of_unknown_kind_is_read_by_whichever_gauges_it_has() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1, engine="vllm", external_load=2) as (fake,),
            reading([record(fake.url, None)]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(known(worker))
            assert worker.load == 2.0 and loads.source_of(worker.id) == LoadSource.METRICS


async def test_dp_ranks_are_read_one_by_one_for_a_worker_whose_rank_the_router_picks() -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet(1, engine="vllm", dp_size=2, external_load=3) as (fake,),
            reading([record(fake.url, "vllm", dp_size=2)]) as (fleet, _),
        ):
            worker = fleet.workers()[0]
            await wait_until(known(worker))
            assert [worker.rank_load(rank) for rank in (0, 1)] == [3.0, 0.0]
            assert worker.load == 3.0


async def test_sglang_without_v1_loads_is_read_from_its_metrics() -> None:
    metrics = b'sglang:num_running_reqs{dp_rank="0"} 2\nsglang:num_queue_reqs{dp_rank="0"} 1\n'

    async def respond(exchange: Exchange) -> None:
        if exchange.request.target == b"/metrics":
            await exchange.respond(200, [], metrics)
        else:
            await exchange.respond(404, [], b"{}")

    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(respond) as upstream,
            reading([record(upstream.url, "sglang")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(known(worker))
            assert worker.load == 3.0 and loads.source_of(worker.id) == LoadSource.METRICS


def _answering(status: int, body: bytes) -> Callable[[Exchange], Awaitable[None]]:
    async def respond(exchange: Exchange) -> None:
        await exchange.respond(status, [], body)

    return respond


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, b"\x00\xff garbage {{{", "bad_answer"),
        (200, b'vllm:num_requests_running{engine="0"} NaN\n', "bad_answer"),
        (500, b"boom", "failed"),
        (200, b"vllm:num_requests_running 4\n", "bad_answer"),  # waiting missing
    ],
    ids=["garbage", "nan-only", "5xx", "gauge-missing"],
)
async def test_an_answer_that_is_not_load_leaves_it_unknown(
    status: int, body: bytes, outcome: str
) -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(_answering(status, body)) as upstream,
            reading([record(upstream.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            worker.begin(None, now=trio.current_time())
            await wait_until(lambda: loads.reads[(LoadSource.METRICS, outcome)] >= 3)
            assert worker.engine_share() is None
            assert worker.load == 1.0  # our own count, not zero and not a stale figure


async def test_a_reading_that_stops_coming_is_bridged_once_then_unknown_and_known_again_after() -> (
    None
):
    answering = trio.Event()
    serving = {"on": True}

    async def respond(exchange: Exchange) -> None:
        if not serving["on"]:
            await trio.sleep_forever()  # the engine hangs: the read times out
        await exchange.respond(
            200, [], b"vllm:num_requests_running 1\nvllm:num_requests_waiting 6\n"
        )
        answering.set()

    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(respond) as upstream,
            reading([record(upstream.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(known(worker))
            assert worker.load == 7.0
            serving["on"] = False
            share = worker.engine_share()
            assert share is not None
            last_read = share[1]
            await wait_until(lambda: loads.reads[(LoadSource.METRICS, "timeout")] >= 1)
            # One slow read is bridged: the last reading stands, never older than the
            # interval plus the timeout while it does.
            assert worker.engine_share() == share and worker.load == 7.0
            await wait_until(unknown(worker))
            # A second slow read in a row is not: unknown, never past interval + 2 x timeout.
            assert loads.reads[(LoadSource.METRICS, "timeout")] >= 2
            age = trio.current_time() - last_read
            assert (
                FAST.interval_s + FAST.timeout_s < age <= FAST.interval_s + 2 * FAST.timeout_s + 0.3
            )
            assert worker.load == 0.0  # our own count: we have nothing in flight
            serving["on"] = True
            await wait_until(known(worker))
            assert worker.load == 7.0


async def _run_engine(
    settings: FakeWorkerSettings,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        worker = FakeWorker(dataclasses.replace(settings, host="127.0.0.1"))
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_fake_worker, worker.settings, worker=worker)
            )
            task_status.started(worker.port)


async def test_an_engine_that_restarts_is_unknown_while_down_and_read_again_after() -> None:
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as engines:
            first = trio.CancelScope()
            port = await engines.start(
                _run_engine, FakeWorkerSettings(engine="vllm", external_load=4), first
            )
            async with reading([record(f"http://127.0.0.1:{port}", "vllm")]) as (fleet, loads):
                worker = fleet.workers()[0]
                await wait_until(lambda: worker.load == 4.0)
                first.cancel()  # the engine dies: refused connections
                await wait_until(unknown(worker))
                assert loads.reads[(LoadSource.METRICS, "failed")] >= 1
                second = trio.CancelScope()
                await engines.start(
                    _run_engine,
                    FakeWorkerSettings(engine="vllm", external_load=1, port=port),
                    second,
                )
                await wait_until(lambda: worker.load == 1.0)
                second.cancel()


async def test_a_worker_that_leaves_mid_read_takes_its_reader_with_it() -> None:
    entered = trio.Event()

    async def hang(exchange: Exchange) -> None:
        entered.set()
        await exchange.hold_until_peer_closes()

    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(hang) as upstream,
            reading([record(upstream.url, "vllm")]) as (fleet, loads),
        ):
            await entered.wait()
            await wait_until(lambda: upstream.requests == 2)  # /metrics and /load, both held
            assert loads.readers() == 1
            fleet.remove(upstream.url)
            await wait_until(lambda: loads.readers() == 0)
            # The cancelled reads closed their connections: the engine sees them go.
            await upstream.wait_ended(2)
            assert upstream.requests == 2


async def test_a_pushed_stream_is_followed_and_its_silence_is_unknown() -> None:
    settings = FakeWorkerSettings(engine="sglang", load_events=True, external_load=2)
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([settings]) as (fake,):
            async with trio.open_nursery() as publishers:
                await publishers.start(serve_load_publisher, fake.worker)
                async with reading([record(fake.url, "sglang")]) as (fleet, loads):
                    worker = fleet.workers()[0]
                    await wait_until(known(worker))
                    assert loads.source_of(worker.id) == LoadSource.STREAM
                    assert worker.load == 2.0
                    fake.worker.behaviour.external_load = 5
                    await wait_until(lambda: worker.load == 5.0)
                    publishers.cancel_scope.cancel()
                    await wait_until(unknown(worker))
                    assert loads.reads[(LoadSource.STREAM, "silent")] >= 1


# -- vLLM's /load ------------------------------------------------------------------------


async def test_a_vllm_engine_that_counts_its_requests_is_read_on_load_ahead_of_its_gauges() -> None:
    # The gauges step once a minute: whatever moves the figure now came from /load.
    settings = FakeWorkerSettings(
        engine="vllm", enable_server_load_tracking=True, external_load=2, gauge_step_ms=60_000
    )
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet([settings]) as (fake,),
            reading([record(fake.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(lambda: loads.source_of(worker.id) == LoadSource.SERVER_LOAD)
            assert worker.load == 2.0
            fake.worker.behaviour.external_load = 5
            await wait_until(lambda: worker.load == 5.0)
            assert fake.worker.gauge_loads()[0].running == 2  # the gauges still say 2
            metrics_reads = fake.worker.routing.paths["/metrics"]
            assert fake.worker.routing.paths["/load"] > metrics_reads  # the faster read
            assert loads.reads[(LoadSource.SERVER_LOAD, "ok")] >= 2


async def test_a_vllm_engine_that_does_not_count_is_never_read_as_idle() -> None:
    settings = FakeWorkerSettings(engine="vllm", external_load=3)  # /load answers 0
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet([settings]) as (fake,),
            reading([record(fake.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "unproven")] >= 5)
            assert loads.source_of(worker.id) == LoadSource.METRICS
            assert worker.load == 3.0
            assert loads.reads[(LoadSource.SERVER_LOAD, "ok")] == 0


def _engine_with_load(answers: list[bytes]) -> Callable[[Exchange], Awaitable[None]]:
    """A vLLM engine whose gauges say 4 in flight and whose /load answers `answers` in
    turn, the last one for ever after."""

    async def respond(exchange: Exchange) -> None:
        if exchange.request.target == b"/load":
            body = answers.pop(0) if len(answers) > 1 else answers[0]
            await exchange.respond(200, [], body)
        else:
            await exchange.respond(
                200, [], b"vllm:num_requests_running 4\nvllm:num_requests_waiting 0\n"
            )

    return respond


async def test_an_engine_that_stops_counting_is_read_from_its_metrics_again() -> None:
    # Proven (2), then 0 for ever while this router holds a request there sent long ago:
    # an engine restarted without --enable-server-load-tracking.
    answers = [b'{"server_load": 2}', b'{"server_load": 0}']
    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(_engine_with_load(answers)) as upstream,
            reading([record(upstream.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            worker.begin(None, now=trio.current_time() - 10)
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "ok")] >= 1)
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "bad_answer")] >= 1)
            assert loads.source_of(worker.id) == LoadSource.METRICS
            await wait_until(lambda: worker.load == 4.0)  # the gauges' 4, ours among them
            # Two undercounts in a row are a race, not a lie; the third stops its use.
            assert loads.reads[(LoadSource.SERVER_LOAD, "ok")] >= 3


async def test_one_slow_load_read_is_bridged_and_a_second_hands_the_figure_to_the_metrics() -> None:
    state = {"hang": 0, "count": 3}

    async def respond(exchange: Exchange) -> None:
        if exchange.request.target == b"/load":
            if state["hang"]:
                state["hang"] -= 1
                await trio.sleep_forever()  # this read times out
            await exchange.respond(200, [], b'{"server_load": %d}' % state["count"])
        else:
            await exchange.respond(
                200, [], b"vllm:num_requests_running 4\nvllm:num_requests_waiting 0\n"
            )

    settings = dataclasses.replace(FAST, timeout_s=0.2, interval_s=5.0)  # /metrics: rare
    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(respond) as upstream,
            reading([record(upstream.url, "vllm")], settings) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(lambda: loads.source_of(worker.id) == LoadSource.SERVER_LOAD)
            # A slow read, then 0: counted as a reading only while /load still rules (an
            # unproven 0 would not bring it back).
            state["hang"], state["count"] = 1, 0
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "timeout")] == 1)
            ok = loads.reads[(LoadSource.SERVER_LOAD, "ok")]
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "ok")] > ok)
            assert loads.source_of(worker.id) == LoadSource.SERVER_LOAD and worker.load == 0.0
            assert loads.reads[(LoadSource.SERVER_LOAD, "unproven")] == 0
            state["hang"] = 2
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "timeout")] == 3)
            # The second slow read in a row: /load rules no more, the figure is unknown
            # until /metrics reads (here: every 5 s).
            assert loads.source_of(worker.id) == LoadSource.METRICS
            assert worker.engine_share() is None and worker.load == 0.0


@pytest.mark.parametrize(
    ("answers", "ok_reads"),
    [
        # Proven (2), then 0 for ever while the gauges say 4: another router's requests on
        # an engine restarted without the flag, which this router's own count cannot show.
        ([b'{"server_load": 2}', b'{"server_load": 0}'], None),
        # Proven (3), then a count that is none.
        ([b'{"server_load": 3}', b'{"server_load": -1}'], 1),
    ],
    ids=["gauges-above-load", "not-a-count"],
)
async def test_a_load_that_cannot_be_right_hands_the_figure_back_to_the_metrics(
    answers: list[bytes], ok_reads: int | None
) -> None:
    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(_engine_with_load(answers)) as upstream,
            reading([record(upstream.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(lambda: loads.reads[(LoadSource.SERVER_LOAD, "bad_answer")] >= 1)
            assert loads.source_of(worker.id) == LoadSource.METRICS
            await wait_until(lambda: worker.load == 4.0)
            if ok_reads is not None:
                assert loads.reads[(LoadSource.SERVER_LOAD, "ok")] == ok_reads


async def test_an_engine_without_load_is_asked_once() -> None:
    async def respond(exchange: Exchange) -> None:
        if exchange.request.target == b"/load":
            await exchange.respond(404, [], b'{"detail": "Not Found"}')
        else:
            await exchange.respond(
                200, [], b"vllm:num_requests_running 1\nvllm:num_requests_waiting 1\n"
            )

    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(respond) as upstream,
            reading([record(upstream.url, "vllm")]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(lambda: loads.reads[(LoadSource.METRICS, "ok")] >= 5)
            assert worker.load == 2.0
            assert loads.reads[(LoadSource.SERVER_LOAD, "failed")] == 1
            assert sum(loads.reads[(LoadSource.SERVER_LOAD, o)] for o in OUTCOMES) == 1


@pytest.mark.parametrize(
    "fields",
    [{"dp_size": 2}, {"engine": "sglang"}, {"engine": None}],
    ids=["dp", "sglang", "unknown"],
)
async def test_load_is_read_only_from_a_vllm_engine_of_one_rank(fields: dict[str, object]) -> None:
    settings = FakeWorkerSettings(engine="vllm", enable_server_load_tracking=True, dp_size=2)
    if fields.get("dp_size") is None:
        settings = dataclasses.replace(settings, dp_size=1)
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet([settings]) as (fake,),
            reading([record(fake.url, **{"engine": "vllm", **fields})]) as (fleet, loads),
        ):
            worker = fleet.workers()[0]
            await wait_until(lambda: sum(loads.reads.values()) >= 5)
            assert fake.worker.routing.paths.get("/load", 0) == 0
            assert loads.source_of(worker.id) != LoadSource.SERVER_LOAD

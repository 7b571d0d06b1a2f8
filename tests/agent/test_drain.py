from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from router.agent.drain import (
    DrainReport,
    DrainResult,
    DrainSettings,
    read_engine_load,
    wait_engine_idle,
)
from router.engines.metrics import EngineLoad, parse_engine_load

SETTINGS = DrainSettings(poll_interval_s=0.5, settle_s=6.0, timeout_s=300.0)


def load_of(total: float | None) -> EngineLoad:
    if total is None:
        return EngineLoad(running=None, queued=None, handoff=None, kv_usage=None)
    return EngineLoad(running=total, queued=0.0, handoff=0.0, kv_usage=0.1)


class ScriptedEngine:
    """Answers each reading with the next scripted load, then `then` forever.

    Records the virtual time of every call, relative to its creation.
    """

    def __init__(self, script: Sequence[EngineLoad], then: EngineLoad | None = None) -> None:
        self.script = list(script)
        self.then = then
        self.started = trio.current_time()
        self.times: list[float] = []

    async def __call__(self) -> EngineLoad:
        self.times.append(trio.current_time() - self.started)
        await trio.lowlevel.checkpoint()
        if self.script:
            return self.script.pop(0)
        assert self.then is not None, "read past the end of the script"
        return self.then

    def elapsed(self) -> float:
        return trio.current_time() - self.started


def scripted(totals: Sequence[float | None], then: float | None = None) -> ScriptedEngine:
    return ScriptedEngine([load_of(t) for t in totals], None if then is None else load_of(then))


def grid(start: float, stop: float, step: float = 0.5) -> list[float]:
    """Poll times from start to stop inclusive; exact for halves."""
    count = round((stop - start) / step)
    return [start + i * step for i in range(count + 1)]


async def test_idle_from_the_start_waits_exactly_the_settle_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = scripted([], then=0.0)
    report = await wait_engine_idle(engine, SETTINGS)
    assert report == DrainReport(DrainResult.IDLE, waited_s=6.0, last_load=0.0, readings=13)
    assert engine.times == grid(0.0, 6.0)
    assert engine.elapsed() == 6.0


async def test_settle_window_runs_from_the_first_zero(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = scripted([3, 2, 1], then=0.0)
    report = await wait_engine_idle(engine, SETTINGS)
    # First zero at 1.5, so idle at exactly 1.5 + 6.0.
    assert report == DrainReport(DrainResult.IDLE, waited_s=7.5, last_load=0.0, readings=16)
    assert engine.times[-1] == 7.5


async def test_settle_window_off_the_poll_grid_rounds_up_to_the_next_poll(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = scripted([], then=0.0)
    settings = DrainSettings(poll_interval_s=0.5, settle_s=1.2, timeout_s=300.0)
    report = await wait_engine_idle(engine, settings)
    assert engine.times == [0.0, 0.5, 1.0, 1.5]
    assert report.result is DrainResult.IDLE
    assert report.waited_s == 1.5


async def test_zero_settle_takes_the_first_zero(autojump_clock: trio.testing.MockClock) -> None:
    engine = scripted([4], then=0.0)
    settings = DrainSettings(poll_interval_s=0.5, settle_s=0.0, timeout_s=300.0)
    report = await wait_engine_idle(engine, settings)
    assert report == DrainReport(DrainResult.IDLE, waited_s=0.5, last_load=0.0, readings=2)


async def test_lagging_gauge_restarts_the_settle_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Zero right after SIGTERM, then the gauge catches up with a request it had not counted.
    engine = scripted([0, 0, 0, 0, 0, 2, 1], then=0.0)
    report = await wait_engine_idle(engine, SETTINGS)
    # The zero-run that starts at 3.5 is the one that counts: idle at 9.5, not at 6.0.
    assert report == DrainReport(DrainResult.IDLE, waited_s=9.5, last_load=0.0, readings=20)
    assert engine.times == grid(0.0, 9.5)


async def test_one_non_zero_just_before_settling_restarts_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Eleven zeros (0.0 .. 5.0), then a blip at 5.5, one poll short of settling.
    engine = scripted([0] * 11 + [1], then=0.0)
    report = await wait_engine_idle(engine, SETTINGS)
    assert report.result is DrainResult.IDLE
    assert report.waited_s == 12.0
    assert report.readings == 25


def sglang_page(running: tuple[int, int, int, int]) -> str:
    lines = [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
    ]
    lines += [
        f'sglang:num_running_reqs{{dp_rank="{rank}",model_name="m",tp_rank="0"}} {value}.0'
        for rank, value in enumerate(running)
    ]
    lines += [
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
        "# TYPE sglang:num_queue_reqs gauge",
    ]
    lines += [
        f'sglang:num_queue_reqs{{dp_rank="{rank}",model_name="m",tp_rank="0"}} 0.0'
        for rank in range(4)
    ]
    return "\n".join(lines) + "\n"


async def test_one_busy_rank_keeps_the_engine_busy(autojump_clock: trio.testing.MockClock) -> None:
    busy = parse_engine_load(sglang_page((0, 0, 1, 0)), "sglang")
    idle = parse_engine_load(sglang_page((0, 0, 0, 0)), "sglang")
    engine = ScriptedEngine([busy] * 8, then=idle)
    report = await wait_engine_idle(engine, SETTINGS)
    # Three idle ranks never make the engine idle: the window opens at the first all-zero
    # reading, 8 polls in.
    assert report == DrainReport(DrainResult.IDLE, waited_s=10.0, last_load=0.0, readings=21)


async def test_one_busy_rank_runs_out_the_timeout(autojump_clock: trio.testing.MockClock) -> None:
    busy = parse_engine_load(sglang_page((0, 0, 0, 2)), "sglang")
    engine = ScriptedEngine([], then=busy)
    settings = DrainSettings(poll_interval_s=0.5, settle_s=6.0, timeout_s=20.0)
    report = await wait_engine_idle(engine, settings)
    assert report == DrainReport(DrainResult.TIMEOUT, waited_s=20.0, last_load=2.0, readings=40)


async def test_unknown_stops_at_once_and_warns(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.agent.drain")
    engine = scripted([2, 1, None], then=0.0)
    report = await wait_engine_idle(engine, SETTINGS)
    assert report == DrainReport(DrainResult.UNKNOWN, waited_s=1.0, last_load=None, readings=3)
    assert engine.elapsed() == 1.0
    records = [r for r in caplog.records if r.name == "router.agent.drain"]
    assert [r.levelno for r in records] == [logging.WARNING]
    message = records[0].getMessage()
    assert "cannot be read" in message
    assert "rather than claim the engine is idle" in message
    assert "running, queued, handoff" in message


async def test_unknown_during_a_zero_run_is_not_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = scripted([0] * 12 + [None], then=0.0)
    report = await wait_engine_idle(engine, SETTINGS)
    assert report.result is DrainResult.UNKNOWN
    assert report.waited_s == 6.0
    assert report.readings == 13


async def test_missing_queue_gauge_is_unknown_not_idle(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    page = "\n".join(line for line in sglang_page((0, 0, 0, 0)).splitlines() if "queue" not in line)
    engine = ScriptedEngine([], then=parse_engine_load(page, "sglang"))
    report = await wait_engine_idle(engine, SETTINGS)
    assert report == DrainReport(DrainResult.UNKNOWN, waited_s=0.0, last_load=None, readings=1)
    assert "unknown: queued)" in caplog.records[-1].getMessage()


async def test_timeout_is_absolute_from_the_start(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.agent.drain")
    engine = scripted([], then=1.0)
    report = await wait_engine_idle(engine, SETTINGS)
    assert report == DrainReport(DrainResult.TIMEOUT, waited_s=300.0, last_load=1.0, readings=600)
    assert engine.elapsed() == 300.0
    assert engine.times[-1] == 299.5
    [record] = [r for r in caplog.records if r.name == "router.agent.drain"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().endswith(
        "after 300.0s and 600 reading(s); last reading: 1 request(s)"
    )


async def test_timeout_cuts_a_settle_window_short(autojump_clock: trio.testing.MockClock) -> None:
    engine = scripted([1] * 10, then=0.0)
    settings = DrainSettings(poll_interval_s=0.5, settle_s=6.0, timeout_s=10.0)
    report = await wait_engine_idle(engine, settings)
    # Zero from 5.0 would settle at 11.0; the deadline at 10.0 wins.
    assert report == DrainReport(DrainResult.TIMEOUT, waited_s=10.0, last_load=0.0, readings=20)


async def test_timeout_cancels_a_hung_reading(autojump_clock: trio.testing.MockClock) -> None:
    calls = 0

    async def hangs() -> EngineLoad:
        nonlocal calls
        calls += 1
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    settings = DrainSettings(poll_interval_s=0.5, settle_s=6.0, timeout_s=30.0)
    report = await wait_engine_idle(hangs, settings)
    assert report == DrainReport(DrainResult.TIMEOUT, waited_s=30.0, last_load=None, readings=0)
    assert calls == 1


async def test_idle_is_logged_in_one_info_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.agent.drain")
    await wait_engine_idle(scripted([5], then=0.0), SETTINGS)
    [record] = [r for r in caplog.records if r.name == "router.agent.drain"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == "drain: engine idle for 6.0s, after 6.5s and 14 reading(s)"


@pytest.mark.parametrize(
    "kwargs",
    [{"poll_interval_s": 0.0}, {"settle_s": -1.0}, {"timeout_s": 0.0}, {"poll_interval_s": -1}],
)
def test_settings_reject_values_that_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        DrainSettings(**kwargs)


# --- read_engine_load over real loopback sockets (real clock) -------------------------


class MetricsServer:
    """Answers every request with one fixed status and body, counting requests."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        self.requests: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            received += chunk
        self.requests.append(received.split(b"\r\n", 1)[0])
        head = (
            f"HTTP/1.1 {self.status} X\r\n"
            "content-type: text/plain; version=0.0.4; charset=utf-8\r\n"
            f"content-length: {len(self.body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode()
        await stream.send_all(head + self.body)
        await stream.aclose()

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await nursery.start(partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        return f"http://127.0.0.1:{port}/metrics"


async def read_from(server: MetricsServer, engine: str) -> EngineLoad:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await server.start(nursery)
            async with httpx.AsyncClient(trust_env=False) as http:
                load = await read_engine_load(http, url, engine)
            nursery.cancel_scope.cancel()
    return load


async def test_read_engine_load_over_http() -> None:
    server = MetricsServer(200, sglang_page((0, 3, 0, 1)).encode())
    load = await read_from(server, "sglang")
    assert load.running == 4.0
    assert load.queued == 0.0
    assert load.total == 4.0
    assert server.requests == [b"GET /metrics HTTP/1.1"]


async def test_read_engine_load_non_200_is_unknown(caplog: pytest.LogCaptureFixture) -> None:
    # SGLang without --enable-metrics answers 404; its body must not be parsed as load.
    server = MetricsServer(404, b"")
    load = await read_from(server, "sglang")
    assert load == EngineLoad(running=None, queued=None, handoff=None, kv_usage=None)
    assert len(server.requests) == 1
    assert "HTTP 404" in caplog.records[-1].getMessage()


async def test_read_engine_load_refused_port_is_unknown(caplog: pytest.LogCaptureFixture) -> None:
    # Bound but not listening: the port stays ours and every connect is refused.
    with socket.socket() as reserved, trio.fail_after(10):
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        async with httpx.AsyncClient(trust_env=False) as http:
            load = await read_engine_load(http, f"http://127.0.0.1:{port}/metrics", "vllm")
    assert load == EngineLoad(running=None, queued=None, handoff=None, kv_usage=None)
    assert load.total is None
    assert "ConnectError" in caplog.records[-1].getMessage()


async def test_read_engine_load_unknown_engine_raises_before_any_request() -> None:
    server = MetricsServer(200, sglang_page((0, 0, 0, 0)).encode())
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await server.start(nursery)
            async with httpx.AsyncClient(trust_env=False) as http:
                with pytest.raises(ValueError, match="unknown engine 'atom'"):
                    await read_engine_load(http, url, "atom")
            nursery.cancel_scope.cancel()
    assert server.requests == []


async def test_drain_over_http_reports_unknown_for_a_dead_engine() -> None:
    with socket.socket() as reserved, trio.fail_after(10):
        reserved.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{reserved.getsockname()[1]}/metrics"
        async with httpx.AsyncClient(trust_env=False) as http:
            report = await wait_engine_idle(
                lambda: read_engine_load(http, url, "sglang"), DrainSettings(timeout_s=5.0)
            )
    assert report.result is DrainResult.UNKNOWN
    assert report.readings == 1

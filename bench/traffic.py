"""`python -m bench --traffic`: the traffic policy at overload, on fake workers over HTTP.

Three routers, each a `router serve` process on port 0 in front of fake workers:

- `policy`: `--max-concurrent-requests 8`, priority classes `high,low` (default `high`)
  and a tenant header, so the same process shows fair shares (tenants by header) and
  priority (a flood that claims `low`), and holds the line of clients that disconnect;
- `fifo`: the same limit with neither, one first-in first-out line: the comparison;
- `models`: an alias of two models weighted 95/5 (the canary) and a model whose two
  workers are killed mid-run, with a fallback of one worker.

Every run is bounded in time (`seconds` each, 3 with `--quick`) and in count (the canary's
requests, the disconnecting clients); every wait for the router has a deadline. Figures go
to bench/traffic_report.py, which judges them and writes the block of docs/performance.md.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import BenchError, Proc, python_module, raise_nofile_limit, start
from bench.traffic_report import (
    Canary,
    Disconnects,
    Fallback,
    Flood,
    Latencies,
    TrafficResults,
    markdown,
    write_block,
)
from bench.wrk import find_wrk, run_wrk, write_script

Log = Callable[[str], None]

CHAT_PATH = "/v1/chat/completions"
SLOTS = 8
SERVICE_MS = 50.0
FLOOD_CLIENTS = 10 * SLOTS
THINK_S = 0.02
CANARY_SHARE = 0.05
FALLBACK_CLIENTS = 16
CANARY_CLIENTS = 32
WAIT_S = 60.0
"""Longest wait for the router to reach a state (queue full, queue empty, ...)."""
HOLD_MS = 120_000.0
"""The workers' answer time while the disconnect run holds every slot."""


@dataclass(frozen=True, slots=True)
class Client:
    """One client in a closed loop, sending `headers`, waiting `think_s` between requests."""

    label: str
    headers: dict[str, str]
    think_s: float = THINK_S


def _body(model: str) -> bytes:
    return orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )


def run(out: Path, quick: bool, log: Log, command: str) -> int:
    seconds = 3 if quick else 20
    disconnecting = 200 if quick else 1000
    canary_requests = 2000 if quick else 10_000
    raise_nofile_limit()
    wrk = find_wrk()
    load_before = os.getloadavg()[0]
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="bench-traffic-") as work_dir:
        work = Path(work_dir)
        try:
            fleet = [
                _fake(procs, work, f"worker{index}", "--ttft-ms", f"{SERVICE_MS:g}")
                for index in range(2)
            ]
            v1, v2 = (_fake(procs, work, name, "--model", name) for name in ("chat-v1", "chat-v2"))
            big = [_fake(procs, work, f"big{index}", "--model", "big") for index in range(2)]
            small = _fake(procs, work, "small", "--model", "small")
            limit = ["--max-concurrent-requests", str(SLOTS), "--queue-size", "2000"]
            policy = _router(
                procs,
                work,
                "policy",
                fleet,
                *limit,
                "--priority-classes",
                "high,low",
                "--default-priority",
                "high",
                "--tenant-header",
                "x-tenant",
            )
            fifo = _router(procs, work, "fifo", fleet, *limit)
            models = _router(
                procs,
                work,
                "models",
                [v1, v2, *big, small],
                "--model-alias",
                f"chat=chat-v1:{1 - CANARY_SHARE:g},chat-v2:{CANARY_SHARE:g}",
                "--model-fallback",
                "big=small",
                "--health-interval-s",
                "0.5",
                "--health-failure-threshold",
                "1",
            )
            log(f"fleet and routers up; runs of {seconds:g} s")
            results = trio.run(
                _measure,
                _Setup(
                    policy,
                    fifo,
                    models,
                    fleet,
                    (v1, v2),
                    big,
                    small,
                    seconds,
                    disconnecting,
                    wrk,
                    work,
                ),
                canary_requests,
                log,
            )
        finally:
            for proc in reversed(procs):
                proc.stop()
    report = TrafficResults(
        quick=quick,
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command=command,
        seconds_per_run=seconds,
        load=(load_before, os.getloadavg()[0]),
        slots=SLOTS,
        service_ms=SERVICE_MS,
        flood_clients=FLOOD_CLIENTS,
        idle=results.idle,
        fair=results.fair,
        fifo=results.fifo,
        high=results.high,
        high_fifo=results.high_fifo,
        disconnects=results.disconnects,
        canary=results.canary,
        fallback=results.fallback,
    )
    write_block(out, markdown(report))
    log(f"wrote the traffic block of {out}")
    return 0


@dataclass(frozen=True, slots=True)
class _Endpoint:
    url: str
    proc: Proc


@dataclass(frozen=True, slots=True)
class _Setup:
    policy: _Endpoint
    fifo: _Endpoint
    models: _Endpoint
    fleet: list[_Endpoint]
    canary_fleet: tuple[_Endpoint, _Endpoint]
    big: list[_Endpoint]
    small: _Endpoint
    seconds: int
    disconnecting: int
    wrk: str
    work: Path


def _fake(procs: list[Proc], work: Path, name: str, *flags: str) -> _Endpoint:
    proc = start(
        name,
        python_module("router.cli", "fake-worker", "--port", "0", "--tokens", "4", *flags),
        work,
    )
    procs.append(proc)
    (url,) = proc.wait_for_log(r"fake-worker listening on (http://\S+)")
    return _Endpoint(url, proc)


def _router(
    procs: list[Proc], work: Path, name: str, workers: Sequence[_Endpoint], *flags: str
) -> _Endpoint:
    command = python_module(
        "router.cli",
        "serve",
        "--port",
        "0",
        # INFO logs the listening line and nothing per request.
        "--log-level",
        "info",
        "--max-connections",
        "20000",
        "--queue-timeout-s",
        "300",
        "--wait-for-workers-s",
        "0",
        *(arg for worker in workers for arg in ("--worker", worker.url)),
        *flags,
    )
    proc = start(f"router-{name}", command, work)
    procs.append(proc)
    (url,) = proc.wait_for_log(r"router listening on (http://\S+)")
    return _Endpoint(url, proc)


@dataclass(frozen=True, slots=True)
class _Measured:
    idle: Latencies
    fair: Latencies
    fifo: Latencies
    high: Latencies
    high_fifo: Latencies
    disconnects: Disconnects
    canary: Canary
    fallback: Fallback


async def _measure(setup: _Setup, canary_requests: int, log: Log) -> _Measured:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=WAIT_S * 5, limits=limits) as client:
        light = Client("light tenant", {"x-tenant": "light"})
        idle = await _beside(client, setup, setup.policy.url, light, None)
        log(f"idle: light p99 {idle.p99:.1f} ms")
        flood = {"x-tenant": "flood"}
        fair = await _beside(client, setup, setup.policy.url, light, flood)
        log(f"fair shares: light p99 {fair.p99:.1f} ms")
        fifo = await _beside(client, setup, setup.fifo.url, light, flood)
        log(f"one FIFO line: light p99 {fifo.p99:.1f} ms")
        high_client = Client("high priority", {})
        low = {"x-priority": "low"}
        high = await _beside(client, setup, setup.policy.url, high_client, low)
        log(f"classes: high p99 {high.p99:.1f} ms")
        high_fifo = await _beside(client, setup, setup.fifo.url, high_client, low)
        log(f"one FIFO line: high p99 {high_fifo.p99:.1f} ms")
        canary = await _canary(client, setup, canary_requests)
        log(f"canary: {canary.canary} of {canary.requests}")
        fallback = await _fallback(client, setup)
        log(f"fallback: {fallback.failed} failed, {fallback.marked} marked")
        disconnects = await _disconnects(client, setup)
        log(
            f"disconnects: {disconnects.dispatched} dispatched, "
            f"{disconnects.active_after} slots held, {disconnects.left_counted} counted"
        )
    return _Measured(idle, fair, fifo, high, high_fifo, disconnects, canary, fallback)


async def _beside(
    client: httpx.AsyncClient,
    setup: _Setup,
    url: str,
    one: Client,
    flood: dict[str, str] | None,
) -> Latencies:
    """`one` client in a closed loop for the run's length, beside a flood of
    `FLOOD_CLIENTS` connections from wrk sending `flood`'s headers (None: alone). wrk is
    the flood so that the measured client's own process has nothing else to do."""
    seconds = setup.seconds
    ok_ms: list[float] = []
    failed = 0
    floods: list[Flood] = []

    async def flood_run() -> None:
        assert flood is not None
        name = "flood-" + "-".join(f"{k}-{v}" for k, v in flood.items())
        script = write_script(setup.work, name, _body("fake-model"), flood)
        result = await trio.to_thread.run_sync(
            run_wrk, setup.wrk, url + CHAT_PATH, script, FLOOD_CLIENTS, seconds + 2
        )
        floods.append(Flood(result.requests, result.errors, result.p50_ms, result.p99_ms))

    async with trio.open_nursery() as nursery:
        if flood is not None:
            nursery.start_soon(flood_run)
            # The flood's line fills before the client is measured.
            await trio.sleep(1.0)
        body = _body("fake-model")
        headers = {"content-type": "application/json", **one.headers}
        until = trio.current_time() + seconds
        while trio.current_time() < until:
            started = trio.current_time()
            try:
                response = await client.post(url + CHAT_PATH, content=body, headers=headers)
                served = response.status_code == 200
            except httpx.HTTPError:
                served = False
            if served:
                ok_ms.append((trio.current_time() - started) * 1000)
            else:
                failed += 1
            await trio.sleep(one.think_s)
    return Latencies(one.label, tuple(ok_ms), failed, floods[0] if floods else None)


async def _canary(client: httpx.AsyncClient, setup: _Setup, requests: int) -> Canary:
    """`requests` for the alias at 32 clients; the split as the two workers counted it."""
    before = [await _dispatches(client, worker.url) for worker in setup.canary_fleet]
    remaining = requests
    failed = 0
    body = _body("chat")

    async def sender() -> None:
        nonlocal remaining, failed
        while remaining > 0:
            remaining -= 1
            response = await client.post(
                setup.models.url + CHAT_PATH,
                content=body,
                headers={"content-type": "application/json"},
            )
            if response.status_code != 200:
                failed += 1

    async with trio.open_nursery() as nursery:
        for _ in range(CANARY_CLIENTS):
            nursery.start_soon(sender)
    after = [await _dispatches(client, worker.url) for worker in setup.canary_fleet]
    stable, canary = (now - then for now, then in zip(after, before, strict=True))
    rewrites = _sum(await _scrape(client, setup.models.url), "router_model_rewrites_total", {})
    return Canary(requests, CANARY_SHARE, canary, stable, failed, int(rewrites))


async def _fallback(client: httpx.AsyncClient, setup: _Setup) -> Fallback:
    """16 clients on `big` for the run's length; both its workers killed a third of the way
    in. Every answer is judged: a 200, and whether it carries the fallback's mark."""
    seconds = setup.seconds
    until = trio.current_time() + seconds
    kill_at = seconds / 3
    answers = failed = marked = 0
    body = _body("big")

    async def loop() -> None:
        nonlocal answers, failed, marked
        while trio.current_time() < until:
            answers += 1
            try:
                response = await client.post(
                    setup.models.url + CHAT_PATH,
                    content=body,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError:
                failed += 1
                continue
            if response.status_code != 200:
                failed += 1
            elif response.headers.get("x-router-fallback-from") == "big":
                marked += 1

    async with trio.open_nursery() as nursery:
        for _ in range(FALLBACK_CLIENTS):
            nursery.start_soon(loop)
        await trio.sleep(kill_at)
        for worker in setup.big:
            worker.proc.popen.kill()
    scrape = await _scrape(client, setup.models.url)
    counted = _sum(scrape, "router_model_fallbacks_total", {"model": "big", "fallback": "small"})
    return Fallback(
        requests=answers,
        failed=failed,
        marked=marked,
        counted=int(counted),
        fallback_dispatches=await _dispatches(client, setup.small.url),
        killed_at_s=kill_at,
        seconds=seconds,
    )


async def _disconnects(client: httpx.AsyncClient, setup: _Setup) -> Disconnects:
    """Every slot held by a request the workers keep; then `disconnecting` clients queue
    and close their connections. Nothing of theirs may reach a worker or keep a slot."""
    url = setup.policy.url
    for worker in setup.fleet:
        response = await client.post(worker.url + "/debug/behaviour", json={"ttft_ms": HOLD_MS})
        response.raise_for_status()
    port = int(url.rsplit(":", 1)[1])
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\n\r\n"
        % len(_body("fake-model"))
        + _body("fake-model")
    )
    holders: list[trio.SocketStream] = []
    dispatched_before = sum([await _dispatches(client, w.url) for w in setup.fleet]) + SLOTS
    for _ in range(SLOTS):
        holders.append(await trio.open_tcp_stream("127.0.0.1", port))
        await holders[-1].send_all(request)
    await _until(client, url, "router_admission_active", SLOTS)
    # An admitted holder may still be on its way to its worker: counted once it is there,
    # or it would count as a leaver's dispatch.
    await _until_dispatched(client, setup, dispatched_before)
    # Counted since start: the floods' own queued requests left when wrk stopped.
    left_before = _sum(
        await _scrape(client, url), "router_admission_refused_total", {"reason": "client_left"}
    )
    leavers: list[trio.SocketStream] = []
    try:
        for _ in range(setup.disconnecting):
            leavers.append(await trio.open_tcp_stream("127.0.0.1", port))
            await leavers[-1].send_all(request)
        await _until(client, url, "router_admission_queue_depth", setup.disconnecting)
    finally:
        closed_at = trio.current_time()
        for stream in leavers:
            await stream.aclose()
    await _until(client, url, "router_admission_queue_depth", 0)
    emptied = trio.current_time() - closed_at
    scrape = await _scrape(client, url)
    active = int(_sum(scrape, "router_admission_active", {}))
    left = int(
        _sum(scrape, "router_admission_refused_total", {"reason": "client_left"}) - left_before
    )
    dispatched = sum([await _dispatches(client, w.url) for w in setup.fleet])
    for stream in holders:
        await stream.aclose()
    await _until(client, url, "router_admission_active", 0)
    return Disconnects(
        clients=setup.disconnecting,
        queued=setup.disconnecting,
        left_counted=left,
        dispatched=dispatched - dispatched_before,
        active_after=active - SLOTS,
        holders=SLOTS,
        seconds_to_empty=emptied,
    )


async def _until_dispatched(client: httpx.AsyncClient, setup: _Setup, count: int) -> None:
    """Poll the fleet until its workers have counted `count` dispatches; BenchError after
    WAIT_S."""
    with trio.move_on_after(WAIT_S):
        while True:
            if sum([await _dispatches(client, w.url) for w in setup.fleet]) >= count:
                return
            await trio.sleep(0.05)
    raise BenchError(f"the fleet did not count {count} dispatches within {WAIT_S:g} s")


async def _dispatches(client: httpx.AsyncClient, worker_url: str) -> int:
    response = await client.get(worker_url + "/debug/routing")
    response.raise_for_status()
    dispatches: int = response.json()["dispatches"]
    return dispatches


async def _scrape(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(url + "/metrics")
    response.raise_for_status()
    return response.text


def _sum(scrape: str, name: str, labels: dict[str, str]) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


async def _until(client: httpx.AsyncClient, url: str, name: str, value: float) -> None:
    """Poll `/metrics` until the gauge `name` reads `value`; BenchError after WAIT_S."""
    with trio.move_on_after(WAIT_S):
        while True:
            seen = _sum(await _scrape(client, url), name, {})
            if math.isclose(seen, value):
                return
            await trio.sleep(0.05)
    raise BenchError(f"{url}: {name} did not reach {value:g} within {WAIT_S:g} s")

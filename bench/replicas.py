"""`python -m bench --replicas`: router replicas on fake engines of unequal speed, judged by
how evenly the engines' queues fill.

One fleet of `len(SPEEDS)` fake vLLM engines, each as slow per token as `SPEEDS` says,
`--max-concurrency` so that work beyond it waits (the waiting gauge is real) and gauges
that step (`GAUGE_STEP_MS`) as an engine's do. Closed-loop clients send completions; with
several replicas they are split unevenly (`SPLIT`), as a Service's connections land on
replicas unevenly. Every `SAMPLE_S` the engines' own queues (running + waiting) are read
from their `/debug/routing`; a sample's spread is the longest queue over the mean one, so
1.0 is a fleet whose queues are all alike. Contenders, in turn, on the same fleet:

- one router (`least_load`, reading the engines' load);
- three replicas reading the engines' load (`/load` every 0.1 s, the engines counting
  their requests as vLLM does with `--enable-server-load-tracking`, beside the stepping
  gauges of `/metrics`), with the spread margin and without it, and reading `/metrics`
  only;
- three replicas counting only their own requests (`--engine-load-interval-s 0`): each
  balances its own share and nothing else.
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import trio

from bench import report
from bench.procs import BenchError, Proc, free_port, python_module, start
from bench.run import Log, dump_json, machine, versions

MODEL = "fake-model"
SPEEDS = (10.0, 20.0, 40.0, 80.0)  # ms per token of each engine
TOKENS = 32  # answers of 0.3 to 2.6 s: LLM-like against a 0.5 s reading interval
MAX_CONCURRENCY = 4
GAUGE_STEP_MS = 20.0
CLIENTS = 48
SPLIT = (0.5, 0.3, 0.2)  # the clients' share of each replica
DURATION_S = 30.0
QUICK_DURATION_S = 5.0
SAMPLE_S = 0.05
DIRECT_CLIENTS = (0, 16)
"""Clients sending to the fastest engine past the routers: none, then 16."""
BODY = {"model": MODEL, "prompt": "hello replicas", "max_tokens": TOKENS}
START = "<!-- bench:replicas:start -->"
END = "<!-- bench:replicas:end -->"


@dataclass(frozen=True, slots=True)
class ReplicaContender:
    name: str
    replicas: int
    flags: tuple[str, ...] = ()


CONTENDERS = (
    ReplicaContender("one router", 1),
    ReplicaContender("3 replicas, engine load", 3),
    ReplicaContender(
        "3 replicas, engine load from /metrics only", 3, ("--engine-server-load-interval-s", "0")
    ),
    ReplicaContender("3 replicas, engine load, margin 0", 3, ("--spread-margin", "0")),
    ReplicaContender("3 replicas, engine load, window 0.1 s", 3, ("--engine-load-window-s", "0.1")),
    ReplicaContender("3 replicas, own count only", 3, ("--engine-load-interval-s", "0")),
)


@dataclass(frozen=True, slots=True)
class ReplicaRun:
    contender: str
    requests: int
    errors: int
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    spread_mean: float
    """The mean over samples of the longest engine queue over the mean one."""
    spread_p95: float
    longest_queue_p99: float
    per_engine: tuple[int, ...]
    samples: int

    def summary(self) -> str:
        return (
            f"{self.contender}: {self.requests_per_s:.0f} req/s, p50 {self.latency_p50_ms:.0f} ms"
            f" p99 {self.latency_p99_ms:.0f} ms, spread {self.spread_mean:.2f}"
            f" (p95 {self.spread_p95:.2f}), longest queue p99 {self.longest_queue_p99:.0f},"
            f" per engine {self.per_engine}, {self.errors} errors"
        )


def percentile(values: Sequence[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def spread(queues: Sequence[int]) -> float | None:
    """The longest queue over the mean one; None for an idle fleet."""
    mean = sum(queues) / len(queues)
    return max(queues) / mean if mean > 0 else None


def run(out: Path, quick: bool, log: Log, command: str) -> int:
    duration = QUICK_DURATION_S if quick else DURATION_S
    header = {**machine(), **versions(), "command": command}
    runs: list[ReplicaRun] = []
    started = time.monotonic()
    engines: list[Proc] = []
    scratch = tempfile.TemporaryDirectory(prefix="bench-replicas-")
    work = Path(scratch.name)
    try:
        urls = []
        for index, speed in enumerate(SPEEDS):
            port = free_port()
            command_line = python_module(
                "router.cli",
                "fake-worker",
                "--port",
                str(port),
                "--engine",
                "vllm",
                "--model",
                MODEL,
                "--token-latency-ms",
                str(speed),
                "--max-concurrency",
                str(MAX_CONCURRENCY),
                "--gauge-step-ms",
                str(GAUGE_STEP_MS),
                "--enable-server-load-tracking",
            )
            engines.append(start(f"engine{index}", command_line, work))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(engines, urls, strict=True):
            proc.wait_for_answer(
                url + "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', 30.0
            )
        for direct in DIRECT_CLIENTS:
            for contender in CONTENDERS:
                runs.append(measure(contender, urls, duration, work, log, direct))
    except (BenchError, httpx.HTTPError) as exc:
        log(f"python -m bench --replicas: {exc!r}")
        return 1
    finally:
        for proc in engines:
            proc.stop()
        scratch.cleanup()
    header["wall_s"] = f"{time.monotonic() - started:.0f}"
    report.write_doc(out, markdown(runs, header, duration), start=START, end=END)
    dump_json(
        out.with_name(out.stem + "-replicas.json"),
        {"header": header, "runs": [asdict(r) for r in runs]},
    )
    log(f"wrote {out}")
    return 0


def measure(
    contender: ReplicaContender,
    urls: list[str],
    duration: float,
    work: Path,
    log: Log,
    direct: int = 0,
) -> ReplicaRun:
    routers: list[Proc] = []
    router_urls: list[str] = []
    try:
        for index in range(contender.replicas):
            port = free_port()
            command = python_module("router.cli", "serve", "--port", str(port))
            command += ["--policy", "least_load", "--log-level", "warning", *contender.flags]
            command += [arg for url in urls for arg in ("--worker", url)]
            name = "-".join(re.findall(r"[A-Za-z0-9_.]+", contender.name)) + f"-{index}"
            routers.append(start(name, command, work))
            router_urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(routers, router_urls, strict=True):
            proc.wait_for_answer(
                url + "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', 30.0
            )
        trio.run(_settle, urls)  # the engines idle, the readers' first readings in
        before = trio.run(_dispatches, urls)
        log(f"{contender.name}: {CLIENTS} clients for {duration:.0f} s")
        latencies, errors, samples, wall = trio.run(_load, router_urls, urls, duration, direct)
        after = trio.run(_dispatches, urls)
    finally:
        for proc in routers:
            proc.stop()
    spreads = [s for s in (spread(sample) for sample in samples) if s is not None]
    one = ReplicaRun(
        contender=contender.name + (f", {direct} clients past the routers" if direct else ""),
        requests=len(latencies),
        errors=errors,
        requests_per_s=len(latencies) / wall,
        latency_p50_ms=percentile(latencies, 0.5) * 1000,
        latency_p99_ms=percentile(latencies, 0.99) * 1000,
        spread_mean=statistics.fmean(spreads) if spreads else float("nan"),
        spread_p95=percentile(spreads, 0.95),
        longest_queue_p99=percentile([max(sample) for sample in samples], 0.99),
        per_engine=tuple(b - a for a, b in zip(before, after, strict=True)),
        samples=len(samples),
    )
    log(one.summary())
    return one


async def _dispatches(urls: list[str]) -> list[int]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        return [(await client.get(url + "/debug/routing")).json()["dispatches"] for url in urls]


async def _settle(urls: list[str]) -> None:
    await trio.sleep(1.0)


async def _load(
    router_urls: list[str], engine_urls: list[str], duration: float, direct: int = 0
) -> tuple[list[float], int, list[list[int]], float]:
    latencies: list[float] = []
    errors = [0]
    samples: list[list[int]] = []
    shares = SPLIT[: len(router_urls)] if len(router_urls) > 1 else (1.0,)
    counts = [round(CLIENTS * share / sum(shares)) for share in shares]
    counts[0] += CLIENTS - sum(counts)
    started = trio.current_time()
    deadline = started + duration

    async def client(http: httpx.AsyncClient) -> None:
        while trio.current_time() < deadline:
            sent = trio.current_time()
            try:
                answer = await http.post("/v1/completions", json=BODY)
                if answer.status_code == 200:
                    latencies.append(trio.current_time() - sent)
                else:
                    errors[0] += 1
            except httpx.HTTPError:
                errors[0] += 1

    async def sampler(http: httpx.AsyncClient) -> None:
        while trio.current_time() < deadline:
            queues = []
            for url in engine_urls:
                routing = (await http.get(url + "/debug/routing")).json()
                queues.append(sum(routing["running"]) + sum(routing["queued"]))
            samples.append(queues)
            await trio.sleep(SAMPLE_S)

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with trio.open_nursery() as nursery:
        clients = []
        for url, count in zip(router_urls, counts, strict=True):
            http = httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits)
            clients.append(http)
            for _ in range(count):
                nursery.start_soon(client, http)
        # Clients past the routers, on the fastest engine (a batch job, another router):
        # their requests are not counted, only the engines' own load shows them.
        bypass = httpx.AsyncClient(base_url=engine_urls[0], timeout=60.0, limits=limits)
        clients.append(bypass)
        for _ in range(direct):
            nursery.start_soon(_bypass, bypass, deadline)
        sampling = httpx.AsyncClient(timeout=5.0)
        clients.append(sampling)
        nursery.start_soon(sampler, sampling)
    wall = trio.current_time() - started
    for http in clients:
        await http.aclose()
    return latencies, errors[0], samples, wall


async def _bypass(http: httpx.AsyncClient, deadline: float) -> None:
    while trio.current_time() < deadline:
        try:
            await http.post("/v1/completions", json=BODY)
        except httpx.HTTPError:
            pass


def markdown(runs: Sequence[ReplicaRun], header: dict[str, str], duration: float) -> str:
    lines = [
        START,
        "",
        f"Fake vLLM engines at {', '.join(f'{s:g}' for s in SPEEDS)} ms a token, "
        f"{TOKENS} tokens an answer, {MAX_CONCURRENCY} running at once each (the rest wait), "
        f"gauges stepping every {GAUGE_STEP_MS:g} ms; {CLIENTS} closed-loop clients for "
        f"{duration:g} s, split {' / '.join(f'{s:.0%}' for s in SPLIT)} over three replicas; "
        f"`least_load`. Spread: the longest engine queue (running + waiting) over the mean "
        f"one, sampled every {SAMPLE_S * 1000:g} ms (1.0: all alike).",
        "",
        "| contender | req/s | p50 ms | p99 ms | spread, mean | spread, p95 | longest queue, p99 | requests per engine | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.contender} | {r.requests_per_s:.0f} | {r.latency_p50_ms:.0f} | "
            f"{r.latency_p99_ms:.0f} | {r.spread_mean:.2f} | {r.spread_p95:.2f} | "
            f"{r.longest_queue_p99:.0f} | {' / '.join(str(n) for n in r.per_engine)} | {r.errors} |"
        )
    lines += ["", "Run: " + ", ".join(f"{k} {v}" for k, v in header.items()), "", END, ""]
    return "\n".join(lines)

"""`python -m bench --engine-costs`: what the router's conversations with an engine cost,
on one real vLLM engine (the CPU build, `make engine-env`).

1. Token ids for `kv_aware`: the same chat requests (a four-turn conversation, one at a
   time) through a `kv_aware` router whose ids come from the model's directory read here
   (`--kv-token-sources model_dir`) and through one that asks the engine's `/tokenize`
   per request (`--kv-token-sources engine`), in alternating rounds: the latency the
   ask adds (the router's own count of time spent waiting for it, and the requests' p50),
   the router's CPU per request, and the engine front end's CPU per ask.
2. Engine load: one read of the engine's `/metrics`, and of its `/load` (the engine runs
   with `--enable-server-load-tracking`), its cost to the engine's front end (CPU per
   read) and to the router (the parse of the families read), then what a router reading
   16 fake engines costs in CPU: not at all, `/metrics` every 0.5 s, and beside it `/load`
   every 0.1 s (the defaults).

Results go into their own block of docs/performance.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench import report
from bench.procs import BenchError, Proc, cpu_seconds, free_port, process_tree, python_module, start
from bench.run import Log, machine, versions
from conformance.engines import (
    ENGINE_ENV,
    READY_TIMEOUT_S,
    EngineEnvironment,
    EngineSettings,
    EngineUnavailable,
    engine_argv,
)

START = "<!-- bench:engine-costs:start -->"
END = "<!-- bench:engine-costs:end -->"
MODEL = "tiny"
ROUNDS = 5
REQUESTS_PER_ROUND = 40
METRICS_READS = 200
FAKES = 16
LOAD_WINDOW_S = 20.0
SYSTEM = "You are the router's assistant; answer in one short line. " * 6


def _chat(turn: int) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}]
    for number in range(turn + 1):
        messages.append({"role": "user", "content": f"question {number}: why is the sky blue?"})
        if number < turn:
            messages.append({"role": "assistant", "content": "because of scattering"})
    return {"model": MODEL, "messages": messages, "max_tokens": 1}


def run(out: Path, quick: bool, log: Log, command: str) -> int:
    try:
        environment = EngineEnvironment.from_env()
    except EngineUnavailable as exc:
        log(f"python -m bench --engine-costs: {exc}")
        return 2
    header = {**machine(), **versions(), "command": command}
    rounds = 1 if quick else ROUNDS
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-costs-") as scratch:
        work = Path(scratch)
        port = free_port()
        engine_url = f"http://127.0.0.1:{port}"
        settings = EngineSettings(
            served_model_name=MODEL, extra_args=("--enable-server-load-tracking",)
        )
        engine = start(
            "engine", engine_argv(environment, settings, port), work, ENGINE_ENV, own_group=True
        )
        try:
            engine.wait_for_answer(
                engine_url + "/v1/chat/completions", orjson.dumps(_chat(0)), READY_TIMEOUT_S
            )
            engine_pids = process_tree(engine.pid)
            lines += _token_costs(engine_url, engine_pids, rounds, work, log)
            lines += _metrics_read_cost(engine_url, engine_pids, log)
        except (BenchError, httpx.HTTPError) as exc:
            log(f"python -m bench --engine-costs: {exc!r}")
            return 1
        finally:
            engine.stop()
        lines += _reader_cost(work, quick, log)
    block = "\n".join(
        [
            START,
            "",
            *lines,
            "",
            "Run: " + ", ".join(f"{k} {v}" for k, v in header.items()),
            "",
            END,
            "",
        ]
    )
    report.write_doc(out, block, start=START, end=END)
    log(f"wrote {out}")
    return 0


def _router(
    name: str, flags: list[str], work: Path, log: Log, probe: bytes | None = None
) -> tuple[Proc, str]:
    port = free_port()
    command = python_module("router.cli", "serve", "--port", str(port), "--log-level", "warning")
    proc = start(name, [*command, *flags], work)
    url = f"http://127.0.0.1:{port}"
    if probe is None:
        proc.wait_for_answer(url + "/v1/chat/completions", orjson.dumps(_chat(0)), 60.0)
    else:
        proc.wait_for_answer(url + "/v1/completions", probe, 60.0)
    proc.pids = process_tree(proc.pid)
    return proc, url


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _token_costs(
    engine_url: str, engine_pids: list[int], rounds: int, work: Path, log: Log
) -> list[str]:
    results: dict[str, dict[str, list[float]]] = {}
    bodies = [orjson.dumps(_chat(turn % 4)) for turn in range(REQUESTS_PER_ROUND)]
    # Round 0 warms the engine (its first requests run slower) and is not counted.
    for round_number in range(rounds + 1):
        for source in ("model_dir", "engine"):
            flags = ["--worker", engine_url, "--policy", "kv_aware", "--kv-token-sources", source]
            proc, url = _router(f"router-{source}-{round_number}", flags, work, log)
            try:
                with httpx.Client(timeout=60.0) as client:
                    # Until the router decided its source (the model directory is checked
                    # against the engine first).
                    deadline = time.monotonic() + 60
                    wanted = (
                        f'router_kv_aware_token_source{{model="{MODEL}",source="{source}"}} 1.0'
                    )
                    while wanted not in client.get(url + "/metrics").text:
                        if time.monotonic() > deadline:
                            raise BenchError(f"{source}: the router never chose its token source")
                        time.sleep(0.1)
                    router_cpu, engine_cpu = proc.cpu_seconds(), cpu_seconds(engine_pids)
                    latencies = []
                    for body in bodies:
                        sent = time.perf_counter()
                        answer = client.post(
                            url + "/v1/chat/completions",
                            content=body,
                            headers={"content-type": "application/json"},
                        )
                        latencies.append(time.perf_counter() - sent)
                        if answer.status_code != 200:
                            raise BenchError(f"{source}: {answer.status_code} {answer.text[:200]}")
                    router_cpu = proc.cpu_seconds() - router_cpu
                    engine_cpu = cpu_seconds(engine_pids) - engine_cpu
                    metrics = client.get(url + "/metrics").text
            finally:
                proc.stop()
            asks = _metric(metrics, 'router_kv_aware_engine_tokenize_total{outcome="ok"}')
            waited = _metric(metrics, "router_kv_aware_engine_tokenize_seconds_total")
            if round_number == 0:
                continue
            row = results.setdefault(source, {})
            row.setdefault("p50_ms", []).append(statistics.median(latencies) * 1000)
            row.setdefault("router_cpu_ms", []).append(router_cpu / len(bodies) * 1000)
            row.setdefault("engine_cpu_ms", []).append(engine_cpu / len(bodies) * 1000)
            row.setdefault("ask_ms", []).append(waited / asks * 1000 if asks else 0.0)
            log(
                f"{source} round {round_number}: { ({k: round(v[-1], 2) for k, v in row.items()}) }"
            )
    lines = [
        f"**Token ids for `kv_aware`** (one engine, {REQUESTS_PER_ROUND} chat requests of one "
        f"token in turn, a four-turn conversation's prompts, {rounds} alternating rounds; "
        "medians over the rounds):",
        "",
        "| token source | request p50 ms | wait for /tokenize ms | router CPU ms / request | engine CPU ms / request |",
        "|---|---:|---:|---:|---:|",
    ]
    for source, row in results.items():
        lines.append(
            f"| {source} | {statistics.median(row['p50_ms']):.1f} | "
            f"{statistics.median(row['ask_ms']):.2f} | {statistics.median(row['router_cpu_ms']):.2f} | "
            f"{statistics.median(row['engine_cpu_ms']):.1f} |"
        )
    return [*lines, ""]


def _metrics_read_cost(engine_url: str, engine_pids: list[int], log: Log) -> list[str]:
    from router.engines.load_readings import metrics_readings

    with httpx.Client(timeout=10.0) as client:
        before = cpu_seconds(engine_pids)
        page = ""
        for _ in range(METRICS_READS):
            page = client.get(engine_url + "/metrics").text
        engine_ms = (cpu_seconds(engine_pids) - before) / METRICS_READS * 1000
        before = cpu_seconds(engine_pids)
        for _ in range(METRICS_READS):
            client.get(engine_url + "/load").raise_for_status()
        load_ms = (cpu_seconds(engine_pids) - before) / METRICS_READS * 1000
    started = time.process_time()
    for _ in range(METRICS_READS):
        metrics_readings(page, "vllm")
    parse_us = (time.process_time() - started) / METRICS_READS * 1e6
    log(
        f"/metrics: {len(page)} bytes, engine {engine_ms:.2f} ms CPU a read, parse {parse_us:.0f} us;"
        f" /load: engine {load_ms:.2f} ms CPU a read"
    )
    return [
        f"**Engine load, one read** of the engine's `/metrics` ({len(page) / 1000:.0f} kB): "
        f"{engine_ms:.1f} ms of the engine front end's CPU, {parse_us:.0f} us of the router's "
        f"to read its running, waiting and KV-usage families; of its `/load`: "
        f"{load_ms:.2f} ms of the engine front end's CPU ({METRICS_READS} reads each).",
        "",
    ]


def _reader_cost(work: Path, quick: bool, log: Log) -> list[str]:
    window = 5.0 if quick else LOAD_WINDOW_S
    fakes: list[Proc] = []
    urls = []
    try:
        for index in range(FAKES):
            port = free_port()
            tracked = ("--engine", "vllm", "--enable-server-load-tracking")
            command = python_module("router.cli", "fake-worker", "--port", str(port), *tracked)
            fakes.append(start(f"fake{index}", command, work))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(fakes, urls, strict=True):
            proc.wait_for_answer(
                url + "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', 30.0
            )
        workers = [arg for url in urls for arg in ("--worker", url)]
        rows = []
        for name, flags in (
            ("not read", ["--engine-load-interval-s", "0"]),
            (
                "/metrics every 0.5 s",
                ["--engine-load-interval-s", "0.5", "--engine-server-load-interval-s", "0"],
            ),
            (
                "/metrics every 0.5 s, /load every 0.1 s",
                ["--engine-load-interval-s", "0.5", "--engine-server-load-interval-s", "0.1"],
            ),
        ):
            proc, _ = _router(
                f"reader-{len(rows)}",
                [*workers, "--policy", "least_load", *flags],
                work,
                log,
                b'{"prompt": "hi", "max_tokens": 1}',
            )
            try:
                time.sleep(2.0)
                before = proc.cpu_seconds()
                time.sleep(window)
                rows.append((name, (proc.cpu_seconds() - before) / window * 100))
            finally:
                proc.stop()
            log(f"router, {FAKES} fake engines, load {name}: {rows[-1][1]:.2f}% of a core")
    finally:
        for proc in fakes:
            proc.stop()
    lines = [
        f"**Engine load, a fleet of {FAKES}**: an idle router in front of {FAKES} fake vLLM "
        f"engines, CPU over {window:g} s:",
        "",
        "| engine load | router CPU, % of a core |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {share:.2f} |" for name, share in rows]
    return [*lines, ""]

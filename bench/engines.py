"""`python -m bench --engines`: our router, smg and a direct connection in front of the
same real vLLM engine (the CPU build, `make engine-env`), measured in interleaved rounds.

One engine, so every contender sends the same work to the same place: what differs is
the hop. Per contender and case it reports the requests per second, p50 and p99, the
latency a hop adds over the direct connection (p50 against the direct run of the same
round), the hop's own CPU per request and the engine's. Every request asks for a fixed
number of tokens (`ignore_eos`), and a probe through each contender checks that the
engine generated that many for it before anything is measured, so no contender is
faster for doing less. Results go into their own block of docs/performance.md and a
JSON file beside it. The fake-only cases (paced streams, idle streams, bursts) are not
run: a real engine's pace is its own.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson

from bench import report
from bench.plan import MODEL, UNARY_TOKENS, Case
from bench.procs import BenchError, Proc, free_port, raise_nofile_limit, start
from bench.run import CHAT_PATH, Bench, Log, Measurement, dump_json, machine, versions
from bench.wrk import find_wrk
from conformance.engines import (
    ENGINE_ENV,
    READY_TIMEOUT_S,
    EngineEnvironment,
    EngineSettings,
    EngineUnavailable,
    engine_argv,
)

START = "<!-- bench:engines:start -->"
END = "<!-- bench:engines:end -->"
CONTENDERS = ("direct", "ours", "smg")
CASES: tuple[Case, ...] = (
    Case("engine-unary-c1", "unary, c=1", 1, stream=False, ignore_eos=True),
    Case("engine-unary-c8", "unary, c=8", 8, stream=False, ignore_eos=True),
    Case("engine-stream-c8", "stream, c=8", 8, stream=True, ignore_eos=True),
)
# Per run: ~5 requests a second at c=1 on this CPU build, and CPU read in 10 ms ticks,
# want runs long enough for a hundred requests and a hop's CPU well above one tick.
DEFAULT_DURATION_S = 20


@dataclass(frozen=True, slots=True)
class EngineRow:
    """One contender in one case, over the rounds (medians; CPU summed then divided)."""

    contender: str
    case: str
    rounds: int
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None
    """Median over rounds of p50 minus the direct p50 of the same round; None for direct."""
    hop_cpu_us: float | None
    """The contender's own CPU per request; None for direct (no hop)."""
    engine_cpu_us: float


def run(out: Path, duration_s: int, rounds: int, log: Log, command: str) -> int:
    """The whole session; the exit status (2 when the engine environment is missing)."""
    try:
        environment = EngineEnvironment.from_env()
        wrk = find_wrk()
    except (EngineUnavailable, BenchError) as exc:
        log(f"python -m bench --engines: {exc}")
        return 2
    nofile = raise_nofile_limit()
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as work:
        bench = Bench(Path(work), wrk, duration_s, log, nofile)
        engine: Proc | None = None
        try:
            engine = start_engine(bench, environment, log)
            bench.start_contenders(CONTENDERS)
            tokens = {name: generated_tokens(bench.targets[name].url) for name in CONTENDERS}
            log(f"tokens generated per request, by contender: {tokens}")
            if set(tokens.values()) != {UNARY_TOKENS}:
                raise BenchError(
                    f"the contenders did not ask the same work of the engine: {tokens}"
                )
            measurements = measure_rounds(bench, rounds, log)
        except BenchError as exc:
            log(f"python -m bench --engines: {exc}")
            return 1
        finally:
            bench.close()
            if engine is not None:
                engine.stop()
    rows = summarize(measurements)
    header = {
        **machine(),
        **versions(),
        "engine": f"one vLLM engine (CPU build, `{environment.python}`), model "
        f"`{environment.model_dir.name}`",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "rounds": str(rounds),
        "duration": str(duration_s),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    report.write_doc(out, results_markdown(rows, header), start=START, end=END)
    json_path = out.with_name(out.stem + "-engines.json")
    dump_json(
        json_path,
        {
            "header": header,
            "measurements": [asdict(m) for m in measurements],
            "rows": [asdict(row) for row in rows],
        },
    )
    log(f"wrote {out} and {json_path.name}")
    return 0


def start_engine(bench: Bench, environment: EngineEnvironment, log: Log) -> Proc:
    """One engine serving the bench's model name, in a process group of its own, as the
    bench's whole fleet; returns once it answers a chat request."""
    port = free_port()
    settings = EngineSettings(served_model_name=MODEL)
    command = engine_argv(environment, settings, port)
    proc = start("engine", command, bench.work_dir, ENGINE_ENV, own_group=True)
    url = f"http://127.0.0.1:{port}"
    log(f"starting a vLLM engine on {url} (35-170 s on 2 cores)")
    started = time.monotonic()
    try:
        body = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        proc.wait_for_answer(url + CHAT_PATH, body, timeout_s=READY_TIMEOUT_S)
        # The API server and its engine core: the CPU that generates counts as the fleet's.
        proc.settle_tree(2)
    except BaseException:
        proc.stop()
        raise
    log(f"  engine ready in {time.monotonic() - started:.0f} s (pids {proc.pids})")
    bench.fleet.append(proc)
    bench.fleet_urls.append(url)
    return proc


def generated_tokens(url: str) -> int | None:
    """Completion tokens the engine reports for one unary request of the cases' shape."""
    body = CASES[0].body
    with httpx.Client(timeout=60.0) as client:
        response = client.post(
            url + CHAT_PATH, content=body, headers={"content-type": "application/json"}
        )
    if response.status_code != 200:
        raise BenchError(f"{url}: probe answered {response.status_code}: {response.text[:200]}")
    usage = response.json().get("usage") or {}
    tokens = usage.get("completion_tokens")
    return tokens if isinstance(tokens, int) else None


def measure_rounds(bench: Bench, rounds: int, log: Log) -> list[Measurement]:
    """Each case, round after round, each contender in turn (A B C A B C ...)."""
    measurements: list[Measurement] = []
    for name in CONTENDERS:
        bench.wrk(bench.targets[name], CASES[0].body, 1, 1)  # warm: connections, caches
    for case in CASES:
        for round_ in range(rounds):
            for name in CONTENDERS:
                m = bench.measure(bench.targets[name], case, round_)
                measurements.append(m)
                log(
                    f"{case.name:<17} round {round_ + 1} {name:<7} "
                    f"{m.requests / m.duration_s:7.1f} req/s p50 {m.p50_ms:7.2f} ms "
                    f"p99 {m.p99_ms:7.2f} ms err {m.errors:<3} cpu {m.cpu_s:5.2f} s "
                    f"engine cpu {m.fleet_cpu_s:5.2f} s"
                )
    return measurements


def summarize(measurements: Sequence[Measurement]) -> list[EngineRow]:
    direct_p50 = {(m.case, m.round): m.p50_ms for m in measurements if m.contender == "direct"}
    rows = []
    for case in CASES:
        for name in CONTENDERS:
            runs = [m for m in measurements if m.case == case.name and m.contender == name]
            if not runs:
                continue
            requests = sum(m.requests for m in runs)
            added = [
                m.p50_ms - direct_p50[(m.case, m.round)]
                for m in runs
                if (m.case, m.round) in direct_p50
            ]
            rows.append(
                EngineRow(
                    contender=name,
                    case=case.name,
                    rounds=len(runs),
                    requests=requests,
                    errors=sum(m.errors for m in runs),
                    rps=statistics.median(m.requests / m.duration_s for m in runs),
                    p50_ms=statistics.median(m.p50_ms for m in runs),
                    p99_ms=statistics.median(m.p99_ms for m in runs),
                    added_p50_ms=statistics.median(added) if name != "direct" and added else None,
                    hop_cpu_us=(
                        sum(m.cpu_s for m in runs) / requests * 1e6
                        if name != "direct" and requests
                        else None
                    ),
                    engine_cpu_us=(
                        sum(m.fleet_cpu_s for m in runs) / requests * 1e6 if requests else 0.0
                    ),
                )
            )
    return rows


def _cell(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def results_markdown(rows: Sequence[EngineRow], header: dict[str, str]) -> str:
    titles = {case.name: case.title for case in CASES}
    by_key = {(row.contender, row.case): row for row in rows}
    lines = [
        START,
        "",
        f"Measured {header['date']} with `{header['command']}`: {header['rounds']} round(s) of "
        f"{header['duration']} s per contender and case, on {header['cpus']} cores "
        f"({header['cpu_model']}, load {header['load_at_start']} at the start). "
        f"{header['engine']}; each request asks for {UNARY_TOKENS} tokens (`ignore_eos`).",
        "",
        "| case | contender | req/s | p50 ms | p99 ms | added p50 ms | hop CPU µs/req "
        "| engine CPU µs/req | vs direct req/s | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        direct = by_key.get(("direct", row.case))
        ratio = row.rps / direct.rps if direct and direct.rps else None
        lines.append(
            f"| {titles[row.case]} | {row.contender} | {row.rps:,.1f} | {row.p50_ms:.2f} "
            f"| {row.p99_ms:.2f} | {_cell(row.added_p50_ms, 2)} | {_cell(row.hop_cpu_us, 0)} "
            f"| {row.engine_cpu_us:,.0f} | {_cell(ratio, 2)} | {row.errors} |"
        )
    lines += ["", END, ""]
    return "\n".join(lines)

"""`python -m bench`: run the side-by-side benchmark and write docs/performance.md."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from bench import grpc_row, report
from bench.baseline import compiled_env, prepare
from bench.plan import (
    CASES,
    CONTENDERS,
    DEFAULT_CONTENDERS,
    PROFILED_CASES,
    QUICK_CASES,
    RESUME_CASES,
    RESUME_CONTENDERS,
)
from bench.procs import BenchError, raise_nofile_limit
from bench.run import (
    FLEET_SIZE,
    LITELLM_VENV,
    Bench,
    Log,
    Session,
    dump_json,
    machine,
    versions,
    wrk_version,
)
from bench.wrk import find_wrk

DEFAULT_OUT = Path("docs/performance.md")
IDLE_TIMEOUT_S = 90.0
# Descriptors a process needs besides its streams: listeners, epoll, logs, health checks.
FD_SPARE = 128


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Measure our router against smg, LiteLLM and direct calls on one fake fleet, in "
            "interleaved rounds, and write the results into a Markdown file with a chart."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"1 s runs, cases {', '.join(QUICK_CASES)}, 2,000 idle streams",
    )
    parser.add_argument(
        "--duration",
        type=int,
        default=None,
        help="seconds per run (whole seconds: wrk's unit; default 2)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated, of {', '.join(CONTENDERS)} (default: {', '.join(DEFAULT_CONTENDERS)}; with --fleet-engine vllm: {', '.join(RESUME_CONTENDERS)})",
    )
    parser.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--idle-streams",
        type=int,
        default=None,
        help="idle SSE streams held through `ours` (0 skips; default 10,000)",
    )
    parser.add_argument("--no-burst", action="store_true", help="skip the burst-then-c=1 run")
    parser.add_argument(
        "--no-grpc",
        action="store_true",
        help="skip the gRPC rows (bench/grpc_row.py: ours and smg over HTTP and over gRPC, on fleets of their own, after the cases above)",
    )
    parser.add_argument(
        "--grpc-contenders",
        default="ours,ours-grpc,smg,smg-grpc",
        help="comma-separated, of ours, ours-grpc, smg, smg-grpc (default: all four; smg's left out where smg is not installed)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also run ours-base, the router as of git REF (its tree extracted into the work directory), beside ours in the same interleaved rounds: the A/B of a change (bench/baseline.py); with --compiled-tree, REF's request path is compiled too (1.5 minutes), so that compiled meets compiled",
    )
    parser.add_argument(
        "--compiled-tree",
        metavar="PATH",
        type=Path,
        help="run ours (and its variants) from the compiled build in PATH (`make compiled` builds build/compiled-tree), and ours-pure, this checkout's sources, beside it; refused unless PATH's router says it is compiled (`make bench` gives it)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile `ours` under unary c=32 and stream c=32: py-spy's self and inclusive time by package, module and function, and strace's system calls per request",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="Markdown file; its results block is replaced (default docs/performance.md)",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="print the instructions per request of ours (and ours-base with --baseline), unary and stream, counted under valgrind's callgrind one request at a time, idle work taken off (bench/instructions.py): an A/B without the wall clock's noise",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=500,
        help="with --instructions: requests counted per case (default 500)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="print the router's CPU per request stage by stage (bench/stages.py): micro-benchmarks, and the rest of one short unary c=32 run through ours",
    )
    parser.add_argument(
        "--engines",
        action="store_true",
        help="run the real-engine benchmark instead (bench/engines.py): direct, ours and smg in front of one vLLM engine (make engine-env); writes its own block of --out; --duration defaults to 20 s",
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="run the cache-aware benchmark instead (bench/cache.py): multi-turn conversations on fake workers with prefix caches; writes its own section of --out and of policies.md beside it",
    )
    parser.add_argument(
        "--kv-engines",
        action="store_true",
        help="run the kv_aware benchmark on real engines instead (bench/kv_engines.py): ours kv_aware, cache_aware and round_robin and smg cache_aware in front of three vLLM engines (make engine-env), with caches that evict and caches that do not, --processes 2 and a router restart; writes its own block of policies.md beside --out",
    )
    parser.add_argument(
        "--kv-scenarios",
        default="evicting,roomy",
        help="with --kv-engines: the fleets to run, of evicting, roomy (default both)",
    )
    parser.add_argument(
        "--kv-groups",
        default="side,two,replicas,noflag,ownload,restart",
        help="with --kv-engines: the contenders to run: side (side by side), two (--processes 2), replicas (two independent routers), noflag (kv_aware without --kv-tokenizer), ownload (kv_aware counting its own requests only, not reading the engines' load), restart (a router restart mid-run); margins (kv_aware alone: one process, then two routers at spread margins 0.5 and 0) loadsource (kv_aware alone: one process, then two routers reading the engines' /load and reading /metrics only) and control (kv_aware alone: one process, two routers, and two routers of which one gets every client) run only when named",
    )
    parser.add_argument(
        "--kv-block",
        help="with --kv-engines: write the figures to a block of this name (and "
        "docs/policies-kv-engines-NAME.json) placed after the main table, which is kept",
    )
    parser.add_argument(
        "--kv-repeat",
        type=int,
        default=1,
        help="with --kv-engines: play the contenders this many times over, in turn",
    )
    parser.add_argument(
        "--lora-engines",
        action="store_true",
        help="run the LoRA adapter benchmark on real engines instead (bench/lora_engines.py): adapter and base-model requests from 6 clients through ours least_load with and without the adapter slots weighed, ours round_robin and smg, in front of three vLLM engines with --max-loras 1 holding two of three adapters each (make engine-env); writes its own block of policies.md beside --out",
    )
    parser.add_argument(
        "--lora-repeat",
        type=int,
        default=1,
        help="with --lora-engines: play the contenders this many times over, in turn",
    )
    parser.add_argument(
        "--lora-costs",
        default="",
        help="with --lora-engines: sweep the adapter costs instead, ours least_load once per SLOT:WAIT pair (e.g. 1:4,0:0,0.5:2,2:8 for --adapter-slot-cost and --adapter-wait-cost); writes its own block of policies.md",
    )
    parser.add_argument(
        "--engine-costs",
        action="store_true",
        help="run the engine-costs benchmark instead (bench/engine_costs.py): kv_aware's token ids from the model directory against the engine's /tokenize, and the cost of reading engines' load, on one vLLM engine (make engine-env); writes its own block of --out",
    )
    parser.add_argument(
        "--fleet-engine",
        choices=("sglang", "vllm"),
        default="sglang",
        help=f"the fake fleet's engine kind: vllm streams token ids when asked, so ours-resume captures its streams (the cost of a resumable stream); default sglang. A vllm run plays {', '.join(RESUME_CONTENDERS)} on {', '.join(RESUME_CASES)} unless told, and writes its own block of --out",
    )
    parser.add_argument(
        "--replicas",
        action="store_true",
        help="run the replicas benchmark instead (bench/replicas.py): one router against three replicas reading the engines' load, and three counting only their own, on fake engines of unequal speed; writes its own block of policies.md beside --out",
    )
    parser.add_argument(
        "--traffic",
        action="store_true",
        help="run the traffic-policy benchmark instead (bench/traffic.py): fair shares, priority classes, disconnecting clients, a canary alias and a fallback under a down fleet, on fake workers at overload; writes its own block of --out",
    )
    return parser


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(
            f"python -m bench: unknown {what} {', '.join(unknown)} (known: {', '.join(known)})"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cache:
        from bench import cache

        started = time.monotonic()
        return cache.main(
            args.out,
            args.quick,
            lambda message: print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True),
        )
    if args.engine_costs:
        from bench import engine_costs

        started = time.monotonic()
        return engine_costs.run(
            args.out,
            args.quick,
            lambda message: print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True),
            "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        )
    if args.replicas:
        from bench import replicas

        started = time.monotonic()
        return replicas.run(
            args.out.with_name("policies.md"),
            args.quick,
            lambda message: print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True),
            "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        )
    if args.kv_engines:
        from bench import kv_engines
        from bench.kv_engines_report import markers

        try:
            markers(args.kv_block)  # a bad name refused now, not after an hour of engines
        except ValueError as exc:
            parser.error(f"--kv-block: {exc}")

        started = time.monotonic()
        return kv_engines.run(
            args.out.with_name("policies.md"),
            args.quick,
            lambda message: print(
                f"[{datetime.now():%H:%M:%S} {time.monotonic() - started:6.1f}s] {message}",
                flush=True,
            ),
            "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
            scenarios=_names(args.kv_scenarios, ("evicting", "roomy"), "scenario"),
            groups=_names(
                args.kv_groups,
                [*kv_engines.ALL_GROUPS, "margins", "loadsource", "control"],
                "group",
            ),
            repeat=max(1, args.kv_repeat),
            block=args.kv_block,
        )
    if args.lora_engines:
        from bench import lora_engines

        try:
            costs = lora_engines.parse_costs(args.lora_costs) if args.lora_costs else []
        except ValueError as exc:
            parser.error(f"--lora-costs: {exc}")
        started = time.monotonic()
        return lora_engines.run(
            args.out.with_name("policies.md"),
            args.quick,
            lambda message: print(
                f"[{datetime.now():%H:%M:%S} {time.monotonic() - started:6.1f}s] {message}",
                flush=True,
            ),
            "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
            repeat=max(1, args.lora_repeat),
            costs=costs,
        )
    if args.traffic:
        from bench import traffic

        started = time.monotonic()
        return traffic.run(
            args.out,
            args.quick,
            lambda message: print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True),
            "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        )
    if args.engines:
        from bench import engines

        started = time.monotonic()
        return engines.run(
            args.out,
            args.duration or engines.DEFAULT_DURATION_S,
            args.rounds,
            lambda message: print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True),
            "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        )
    duration = args.duration if args.duration is not None else (1 if args.quick else 2)
    if args.stages:
        return _stages(duration)
    if args.instructions:
        return _instructions(args.requests, args.baseline, args.compiled_tree)
    resume = args.fleet_engine == "vllm"
    default_cases = RESUME_CASES if resume else QUICK_CASES if args.quick else tuple(CASES)
    cases = _names(args.cases or ",".join(default_cases), list(CASES), "case")
    default_contenders = RESUME_CONTENDERS if resume else DEFAULT_CONTENDERS
    contenders = _names(
        args.contenders or ",".join(default_contenders), list(CONTENDERS), "contender"
    )
    grpc_contenders = (
        []
        if args.no_grpc or resume
        else _names(args.grpc_contenders, list(grpc_row.CONTENDER_FLEETS), "gRPC contender")
    )
    idle_count = (
        args.idle_streams
        if args.idle_streams is not None
        else (0 if resume else 2000 if args.quick else 10_000)
    )
    if resume:
        # The vLLM fleet's run measures the relay with and without capture: no burst.
        args.no_burst = True
    if duration < 1 or args.rounds < 1:
        raise SystemExit("python -m bench: --duration and --rounds must be at least 1")
    notes: list[str] = []
    ours_env: dict[str, str] = {}
    if args.compiled_tree is not None:
        try:
            ours_env = compiled_env(args.compiled_tree)
        except BenchError as exc:
            parser.error(str(exc))
        if "ours" in contenders and "ours-pure" not in contenders:
            contenders.insert(contenders.index("ours") + 1, "ours-pure")
    elif "ours-pure" in contenders:
        parser.error("ours-pure runs beside the compiled build: give --compiled-tree")
    if args.baseline and "ours-base" not in contenders:
        contenders.append("ours-base")
    if "ours-base" in contenders and not args.baseline:
        parser.error("ours-base runs the --baseline commit: give one")
    if "smg" in contenders and importlib.util.find_spec("smg") is None:
        contenders.remove("smg")
        notes.append("smg is not installed, so it was left out (pip install smg).")
    if "litellm" in contenders and not (LITELLM_VENV / "bin" / "litellm").exists():
        contenders.remove("litellm")
        notes.append("LiteLLM's venv is missing, so litellm was left out (make litellm-env).")
    if "ours-hypercorn" in contenders and importlib.util.find_spec("hypercorn") is None:
        contenders.remove("ours-hypercorn")
        notes.append("hypercorn is not installed, so ours-hypercorn was left out.")
    try:
        wrk = find_wrk()
    except BenchError as exc:
        print(f"python -m bench: {exc}", file=sys.stderr)
        return 2

    started = time.monotonic()
    nofile = raise_nofile_limit()
    if idle_count > nofile - FD_SPARE:
        notes.append(
            f"The open-file limit ({nofile:,}) caps the idle streams at {nofile - FD_SPARE:,}."
        )
        idle_count = nofile - FD_SPARE

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)

    session = Session(notes=notes)
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        bench = Bench(Path(work), wrk, duration, log, nofile)
        bench.ours_env = ours_env
        try:
            if args.baseline:
                bench.baseline = prepare(
                    args.baseline, Path(work), compiled=bool(ours_env), log=log
                )
                log(f"ours-base: {bench.baseline.label()} in {bench.baseline.tree}")
            _run(bench, session, contenders, cases, args, idle_count, log)
        except BenchError as exc:
            print(f"python -m bench: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.close()

    header = {
        **machine(),
        **versions(),
        "wrk": wrk_version(wrk),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "rounds": str(args.rounds),
        "duration": str(duration),
        "fleet": f"{FLEET_SIZE} ({args.fleet_engine})",
    }
    if bench.baseline is not None:
        header["baseline"] = bench.baseline.label()
    header["build"] = (
        f"the compiled build ({args.compiled_tree})"
        if args.compiled_tree is not None
        else "the pure build (this checkout's sources)"
    )
    header["command"] = header["command"].rstrip()
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    if resume:
        # Its own block and figures file: the default fleet's results and chart stay.
        report.write_doc(
            out,
            report.results_markdown(session, header, None, resume=True),
            start=report.RESUME_START,
            end=report.RESUME_END,
        )
        figures = out.with_name(f"{out.stem}-resume.json")
        dump_json(figures, {"header": header, **session.to_json()})
        log(f"wrote {out} and {figures.name}")
        return 0
    png = out.with_suffix(".png")
    report.write_chart(png, session.measurements)
    report.write_doc(out, report.results_markdown(session, header, png.name))
    dump_json(out.with_suffix(".json"), {"header": header, **session.to_json()})
    log(f"wrote {out}, {png.name} and {out.with_suffix('.json').name}")
    if grpc_contenders:
        return _grpc_rows(out, header, grpc_contenders, duration, args.rounds, log)
    return 0


def _grpc_rows(
    out: Path,
    header: dict[str, str],
    contenders: list[str],
    duration: int,
    rounds: int,
    log: Callable[[str], None],
) -> int:
    """The gRPC rows of `contenders`, on fleets of their own, into their block of `out`
    and their figures file beside it; smg's only where smg is installed."""
    if importlib.util.find_spec("smg") is None:
        contenders = [name for name in contenders if not name.startswith("smg")]
    log(f"the gRPC rows: {', '.join(contenders)}")
    try:
        rows = grpc_row.run(contenders, duration, rounds, log)
    except BenchError as exc:
        print(f"python -m bench: the gRPC rows: {exc}", file=sys.stderr)
        return 1
    report.write_doc(
        out, grpc_row.markdown(rows, header), start=grpc_row.GRPC_START, end=grpc_row.GRPC_END
    )
    figures = out.with_name(f"{out.stem}-grpc.json")
    dump_json(figures, {"header": header, "rows": [dataclasses.asdict(row) for row in rows]})
    log(f"wrote the gRPC rows into {out} and {figures.name}")
    return 0


def _instructions(requests: int, ref: str | None, compiled_tree: Path | None) -> int:
    """The instruction counts on stdout (bench/instructions.py); `ours` the compiled build
    in `compiled_tree` when given."""
    from bench import instructions

    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        try:
            ours_env = None if compiled_tree is None else compiled_env(compiled_tree)
        except BenchError as exc:
            print(f"python -m bench: {exc}", file=sys.stderr)
            return 2
        try:
            baseline = (
                prepare(ref, Path(work), compiled=ours_env is not None, log=log) if ref else None
            )
        except BenchError as exc:
            print(f"python -m bench: {exc}", file=sys.stderr)
            return 1
        return instructions.main_entry(Path(work), requests, baseline, log, ours_env)


def _stages(duration: int) -> int:
    """The stage table on stdout: micro-benchmarks, and the whole from one unary c=32 run."""
    from bench import stages

    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    try:
        wrk = find_wrk()
    except BenchError as exc:
        print(f"python -m bench: {exc}", file=sys.stderr)
        return 2
    nofile = raise_nofile_limit()
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        bench = Bench(Path(work), wrk, duration, log, nofile)
        try:
            bench.start_fleet()
            bench.start_contenders(["ours"])
            case = CASES["unary-c32"]
            bench.wrk(bench.targets["ours"], case.body, case.connections, 1)
            m = bench.measure(bench.targets["ours"], case, 0)
        except BenchError as exc:
            print(f"python -m bench: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.close()
    total_us = m.cpu_s / m.requests * 1e6 if m.requests and m.cpu_s else None
    log(f"unary c=32 through ours: {m.requests:,} requests, {m.cpu_s:.2f} CPU-s")
    print(stages.stage_table(total_us))
    return 0


def _run(
    bench: Bench,
    session: Session,
    contenders: list[str],
    case_names: list[str],
    args: argparse.Namespace,
    idle_count: int,
    log: Log,
) -> None:
    log(f"starting {FLEET_SIZE} fake workers ({args.fleet_engine})")
    bench.start_fleet(args.fleet_engine)
    log(f"starting contenders: {', '.join(contenders)}")
    bench.start_contenders(contenders)
    warm = CASES["unary-c32"]
    for name in contenders:
        bench.wrk(bench.targets[name], warm.body, warm.connections, 1)
    for case_name in case_names:
        case = CASES[case_name]
        bench.set_pace(case.token_latency_ms)
        for round_ in range(args.rounds):
            # Each round starts with the next contender: whoever goes first in a round
            # measured 3-4% below itself going second (an A/A run), so no one always does.
            shift = round_ % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                m = bench.measure(bench.targets[name], case, round_)
                session.measurements.append(m)
                rate = f"{m.requests / m.cpu_s:,.0f}" if m.cpu_s else "n/a"
                log(
                    f"{case.name:<11} round {round_ + 1} {name:<15} {m.requests / m.duration_s:8,.0f} req/s "
                    f"p50 {m.p50_ms:7.2f} ms p99 {m.p99_ms:8.2f} ms err {m.errors:<4} "
                    f"cpu {m.cpu_s:5.2f} s -> {rate} req/cpu-s"
                )
        if case.token_latency_ms:
            bench.set_pace(0.0)
    if not args.no_burst:
        for name in ("ours", "smg"):
            if name in bench.targets:
                log(f"burst then quiet: {name}")
                burst = bench.burst_then_quiet(
                    bench.targets[name], CASES["unary-c256"], CASES["unary-c1"]
                )
                session.bursts.append(burst)
                log(
                    f"  c=1 p50 {burst.before.p50_ms:.3f} ms before, {burst.after.p50_ms:.3f} ms after"
                )
    if args.profile and "ours" in bench.targets:
        for name in PROFILED_CASES:
            log(f"profiling ours under {name} (py-spy, then strace -c)")
            session.profiles.append(bench.profile(bench.targets["ours"], CASES[name]))
    if idle_count and "ours" in bench.targets:
        # A stream holds two sockets in the router: the client's and the worker's.
        per_process = (bench.nofile - FD_SPARE) // 2
        plan = [("ours", min(idle_count, per_process))]
        if per_process < idle_count and "ours-2proc" in bench.targets:
            plan.append(("ours-2proc", idle_count))
            session.notes.append(
                f"The open-file limit ({bench.nofile:,}, which this machine does not let us raise) "
                f"holds one router process to {per_process:,} streams; the full {idle_count:,} "
                "were held through ours-2proc."
            )
        for name, count in plan:
            log(f"holding {count:,} idle streams through {name}")
            held = bench.idle_streams(bench.targets[name], count, IDLE_TIMEOUT_S)
            session.idle.append(held)
            log(
                f"  {held.opened:,} open, RSS {held.rss_held_kb / 1024:,.0f} MB (before {held.rss_before_kb / 1024:,.0f} MB)"
            )

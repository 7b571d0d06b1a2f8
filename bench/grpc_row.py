"""The gRPC rows beside the HTTP ones: ours and smg, each in front of fake HTTP workers and
in front of fake gRPC engines, in one run.

    python -m bench.grpc_row [--duration 5] [--rounds 2] [--json PATH]

`python -m bench` runs it after its own cases (unless `--no-grpc`) and writes its block
between the `bench:grpc` markers of docs/performance.md.

Two fake HTTP workers (`router fake-worker`) and two fake gRPC engines (`router
fake-worker --protocol grpc`) serve the same model; four contenders stand in front:
`ours` and `smg` over HTTP, `ours-grpc` and `smg-grpc` over gRPC (the router renders the
chat template, tokenizes, and makes the answer from the token ids). wrk drives the cases
of `bench.plan` (unary and burst-stream chat at c=32) against each, rounds interleaved;
the figures are the contender's own CPU: requests per CPU-second, and for streams CPU per
streamed token. docs/performance.md ("The gRPC rows") keeps them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.plan import CASES, MODEL, STREAM_TOKENS, UNARY_TOKENS, chat_body
from bench.procs import Proc, free_port, python_module, smg_launch, start
from bench.wrk import find_wrk, run_wrk, write_script

FLEET_SIZE = 2
CHAT_PATH = "/v1/chat/completions"
ROW_CASES = ("unary-c32", "stream-c32")


@dataclass(frozen=True, slots=True)
class Row:
    contender: str
    case: str
    round: int
    requests: int
    errors: int
    duration_s: float
    cpu_s: float
    p50_ms: float
    p99_ms: float

    @property
    def per_cpu_s(self) -> float:
        return self.requests / self.cpu_s if self.cpu_s else 0.0


def _fleet(work: Path, protocol: str) -> tuple[list[Proc], list[str]]:
    procs, urls = [], []
    for index in range(FLEET_SIZE):
        args = ["fake-worker", "--model", MODEL]
        if protocol == "grpc":
            args += ["--protocol", "grpc", "--model-dir", str(work / f"model{index}")]
        else:
            args += ["--port", "0"]
        procs.append(start(f"{protocol}-worker{index}", python_module("router.cli", *args), work))
    for proc in procs:
        (url,) = proc.wait_for_log(r"fake-worker listening on ((?:http|grpc)://\S+)")
        urls.append(url)
    return procs, urls


def _contender(work: Path, name: str, urls: list[str]) -> tuple[Proc, str]:
    port = free_port()
    if name.startswith("ours"):
        command = python_module(
            "router.cli",
            "serve",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            *(arg for url in urls for arg in ("--worker", f"{url},model={MODEL}")),
        )
    else:
        # Two smg processes at once: each its own metrics port.
        command = smg_launch(urls, port, free_port())
    proc = start(name, command, work)
    url = f"http://127.0.0.1:{port}"
    proc.wait_for_answer(url + CHAT_PATH, chat_body(stream=False, tokens=4), timeout_s=60)
    proc.settle_tree(1)
    return proc, url


GRPC_START = "<!-- bench:grpc:start -->"
GRPC_END = "<!-- bench:grpc:end -->"
CONTENDER_FLEETS = {"ours": "http", "ours-grpc": "grpc", "smg": "http", "smg-grpc": "grpc"}


def run(
    contenders: list[str],
    duration_s: int,
    rounds: int,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Start the two fleets and `contenders` (of CONTENDER_FLEETS), measure every case in
    interleaved rounds, stop everything; the rows, one per contender, case and round."""
    wrk = find_wrk()
    rows: list[Row] = []
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="bench-grpc-") as tmp:
        work = Path(tmp)
        try:
            urls: dict[str, list[str]] = {}
            for protocol in sorted({CONTENDER_FLEETS[name] for name in contenders}):
                fleet_procs, urls[protocol] = _fleet(work, protocol)
                procs += fleet_procs
            targets: dict[str, tuple[Proc, str]] = {}
            for name in contenders:
                proc, url = _contender(work, name, urls[CONTENDER_FLEETS[name]])
                procs.append(proc)
                targets[name] = (proc, url)
            scripts = {
                case: write_script(work, case.replace("-", "_"), CASES[case].body)
                for case in ROW_CASES
            }
            for _, url in targets.values():  # warm-up, not counted
                run_wrk(wrk, url + CHAT_PATH, scripts["unary-c32"], 32, 1)
            for round_ in range(rounds):
                for case in ROW_CASES:
                    for name, (proc, url) in targets.items():
                        before = proc.cpu_seconds()
                        result = run_wrk(
                            wrk, url + CHAT_PATH, scripts[case], CASES[case].connections, duration_s
                        )
                        rows.append(
                            Row(
                                name,
                                case,
                                round_,
                                result.requests,
                                result.errors,
                                result.duration_s,
                                proc.cpu_seconds() - before,
                                result.p50_ms,
                                result.p99_ms,
                            )
                        )
                        log(
                            f"grpc row: round {round_ + 1} {case:10} {name:9} "
                            f"{result.requests:6} req {rows[-1].per_cpu_s:7.0f} req/CPU-s "
                            f"errors {result.errors}"
                        )
        finally:
            for proc in reversed(procs):
                proc.stop()
    return rows


def markdown(rows: list[Row], header: Mapping[str, str]) -> str:
    """The block between GRPC_START and GRPC_END: the table, and the gRPC-to-HTTP and
    ours-to-smg ratios of CPU per streamed token where both were measured."""
    per_token = _per_token_us(rows)
    lines = [
        GRPC_START,
        f"Generated by `{header['command']}` on {header['date']}; each contender "
        f"{header['rounds']} interleaved rounds of {header['duration']} s per case (wrk, "
        "1 thread, c=32); two fake HTTP workers and two fake gRPC engines of one model.",
        "",
        table(rows),
        "",
    ]
    ratios = [
        (f"{a} / {b}", per_token.get((case, a)), per_token.get((case, b)), case)
        for case in ROW_CASES
        for a, b in (("ours-grpc", "ours"), ("ours-grpc", "smg-grpc"), ("smg-grpc", "smg"))
    ]
    shown = [
        f"| {name} | {case} | {mine / theirs:.2f} |"
        for name, mine, theirs, case in ratios
        if mine and theirs
    ]
    if shown:
        lines += ["| CPU per token | case | ratio |", "|---|---|--:|", *shown, ""]
    lines.append(GRPC_END)
    return "\n".join(lines) + "\n"


def _per_token_us(rows: list[Row]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for case, contender in {(row.case, row.contender) for row in rows}:
        mine = [row for row in rows if row.case == case and row.contender == contender]
        requests = sum(row.requests for row in mine)
        tokens = requests * (STREAM_TOKENS if CASES[case].stream else UNARY_TOKENS)
        cpu = sum(row.cpu_s for row in mine)
        if tokens and cpu:
            out[(case, contender)] = cpu / tokens * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_row")
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    args = parser.parse_args()
    rows = run(list(CONTENDER_FLEETS), args.duration, args.rounds)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")


def table(rows: list[Row]) -> str:
    """Per contender and case, summed over rounds: req/CPU-s, CPU per token, p50/p99."""
    lines = [
        "| contender | case | requests | errors | req/CPU-s | CPU per token (us) | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(row.case, row.contender) for row in rows})
    for case, contender in keys:
        mine = [row for row in rows if row.case == case and row.contender == contender]
        requests = sum(row.requests for row in mine)
        cpu = sum(row.cpu_s for row in mine)
        tokens = requests * (STREAM_TOKENS if CASES[case].stream else UNARY_TOKENS)
        lines.append(
            f"| {contender} | {case} | {requests:,} | {sum(row.errors for row in mine)} | "
            f"{requests / cpu if cpu else 0:,.0f} | {cpu / tokens * 1e6 if tokens else 0:.1f} | "
            f"{max(row.p50_ms for row in mine):.1f} | {max(row.p99_ms for row in mine):.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

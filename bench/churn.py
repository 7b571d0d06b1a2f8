"""`python -m bench.churn`: upstream connection churn and the tail at c=32 and c=256.

For each contender (ours, ours with an idle pool as large as the per-worker connection
cap, smg, and wrk straight to one fake worker: the fleet's own tail), one unary run per
case; the connections a contender closed toward the workers are counted as the sockets it
left in TIME_WAIT toward the workers' ports (`ss`; the side that closes first holds
TIME_WAIT for 60 s, so the count before and after a run gives what the run closed, idle
connections of earlier runs expiring during it included), and the connections open to
the workers are sampled every 0.25 s for their peak. Also: ours with its connections per
worker capped at 32 (checkouts beyond wait their turn in the router).
Figures go to stdout as a Markdown table.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.plan import CASES, CONTENDERS, Contender
from bench.procs import raise_nofile_limit
from bench.run import Bench
from bench.wrk import find_wrk

IDLE_AS_CAP = "ours-idle256"
CAP_32 = "ours-cap32"
NAMES = ("ours", IDLE_AS_CAP, CAP_32, "smg", "direct")
CASE_NAMES = ("unary-c32", "unary-c256")


def time_wait_toward(ports: list[int]) -> int:
    """Sockets in TIME_WAIT whose remote end is one of `ports` on loopback."""
    out = subprocess.run(
        ["ss", "-tan", "state", "time-wait"], capture_output=True, text=True, check=True
    ).stdout
    wanted = {f"127.0.0.1:{port}" for port in ports}
    return sum(
        1 for line in out.splitlines()[1:] if line.split()[-1:] and line.split()[-1] in wanted
    )


def established_toward(ports: list[int], pids: list[int]) -> int:
    """Connections that one of `pids` holds open to one of `ports` on loopback."""
    out = subprocess.run(
        ["ss", "-tanp", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    wanted = {f"127.0.0.1:{port}" for port in ports}
    owners = tuple(f"pid={pid}," for pid in pids)
    count = 0
    for line in out.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 5 and fields[3] in wanted and any(owner in line for owner in owners):
            count += 1
    return count


def _sample_peak(ports: list[int], pids: list[int], stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.25):
        peak[0] = max(peak[0], established_toward(ports, pids))


def main() -> int:
    CONTENDERS[IDLE_AS_CAP] = Contender(
        IDLE_AS_CAP,
        "router serve --pool-max-idle-per-worker 256",
        ("--pool-max-idle-per-worker", "256"),
    )
    CONTENDERS[CAP_32] = Contender(
        CAP_32,
        "router serve --max-connections-per-worker 32",
        ("--max-connections-per-worker", "32"),
    )
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    rows = [
        "| Contender | Case | req/s | p50 ms | p99 ms | upstream connections closed / s | peak connections open to the workers | router req / CPU-s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        bench = Bench(Path(work), find_wrk(), 2, log, raise_nofile_limit())
        try:
            bench.start_fleet()
            ports = [int(url.rsplit(":", 1)[1]) for url in bench.fleet_urls]
            bench.start_contenders(list(NAMES))
            for case_name in CASE_NAMES:
                case = CASES[case_name]
                for name in NAMES:
                    target = bench.targets[name]
                    before = time_wait_toward(ports)
                    stop = threading.Event()
                    peak = [0]
                    sampler = threading.Thread(
                        target=_sample_peak, args=(ports, target.proc.pids, stop, peak)
                    )
                    sampler.start()
                    try:
                        m = bench.measure(target, case, 0)
                    finally:
                        stop.set()
                        sampler.join()
                    closed = time_wait_toward(ports) - before
                    rate = f"{m.requests / m.cpu_s:,.0f}" if m.cpu_s and name != "direct" else "n/a"
                    rows.append(
                        f"| {name} | {case.name} | {m.requests / m.duration_s:,.0f} | {m.p50_ms:.2f} "
                        f"| {m.p99_ms:.2f} | {closed / m.duration_s:,.0f} | {peak[0] if name != 'direct' else 'n/a'} | {rate} |"
                    )
                    log(rows[-1])
        finally:
            bench.close()
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

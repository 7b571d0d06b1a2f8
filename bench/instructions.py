"""`python -m bench --instructions`: user-space instructions per request, counted.

A wall-clock A/B on this machine has a noise floor of about 2 % (an A/A run reads 0.99-1.01),
so a change worth 1 % cannot be shown by timing it. Counted instructions can: `router
serve` runs under valgrind's callgrind with counting off, one keep-alive client sends
requests one at a time (so no batching at the scheduler moves the count), and counting is
on for exactly `requests` of them. The router's background work (reconcile loops, the pool
sweeper) runs on wall-clock timers, and a router under valgrind is some fifty times slower,
so an idle window of the same router is counted too and its rate times the window's wall
time is taken off. What is left is the request path's own instructions, the same to
within about 0.1 % from run to run (docs/performance.md, "Counting instructions").

What it does not see: the kernel's side of the system calls, cache misses, and the
batching that concurrency brings; a count says what a change removed from the path, the
wall-clock bench says what that is worth. Periodic readers the path does not need are
switched off for the count (health checks, engine load, adapter lists), as is hash
randomisation (PYTHONHASHSEED=0), and the fake workers run outside valgrind.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.baseline import REPO, Baseline
from bench.plan import STREAM_EVENTS, STREAM_TOKENS, UNARY_TOKENS, chat_body
from bench.procs import BenchError, Proc, free_port, python_module, start

Log = Callable[[str], None]

QUIET_FLAGS = (
    "--health-interval-s",
    "100000",
    "--engine-load-interval-s",
    "0",
    "--adapter-list-interval-s",
    "0",
)
"""The periodic readers a request does not need, off while counting."""
WARMUP_REQUESTS = 200
IDLE_S = 10.0
START_S = 600.0
"""A router under valgrind takes a minute or two to import and bind on 2 cores."""
PACED_TOKEN_MS = 10.0
"""Far enough apart that each event is a read of its own through a router under valgrind."""


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    body: bytes
    pace_ms: float = 0.0
    """The fleet's time between tokens (`/debug/behaviour`); 0: as fast as it can."""
    share: int = 1
    """One request of this case for `share` of the others (a paced stream takes long)."""


CASES = (
    Case("unary", chat_body(stream=False, tokens=UNARY_TOKENS)),
    Case("stream", chat_body(stream=True, tokens=STREAM_TOKENS)),
    Case("paced", chat_body(stream=True, tokens=STREAM_TOKENS), PACED_TOKEN_MS, share=10),
)
_PART = re.compile(rb"^part: *(\d+)", re.MULTILINE)
_TOTALS = re.compile(rb"^(?:summary|totals): *(\d+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Count:
    """One case through one router: instructions per request, idle work taken off."""

    case: str
    requests: int
    window: int
    """Instructions counted over the requests' window."""
    window_s: float
    idle_per_s: float

    @property
    def per_request(self) -> float:
        return (self.window - self.idle_per_s * self.window_s) / self.requests


def find_valgrind() -> str:
    path = shutil.which("valgrind")
    if path is None or shutil.which("callgrind_control") is None:
        raise BenchError(
            "valgrind is not installed (Debian/Ubuntu: apt-get install valgrind; or `make "
            "bench-deps`)"
        )
    return path


def request_bytes(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nUser-Agent: bench\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def answer_end(data: bytes) -> int:
    """Where the first whole answer in `data` ends (a content-length or a chunked body),
    or -1 while it is not whole."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return -1
    length = re.search(rb"(?im)^content-length: *(\d+)\r?$", data[:end])
    if length is not None:
        total = end + 4 + int(length.group(1))
        return total if len(data) >= total else -1
    last = data.find(b"\r\n0\r\n\r\n", end)
    return -1 if last < 0 else last + 7


class Client:
    """One keep-alive connection, one request at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.buffer = b""

    def exchange(self, request: bytes) -> None:
        self.sock.sendall(request)
        while (end := answer_end(self.buffer)) < 0:
            data = self.sock.recv(65536)
            if not data:
                raise BenchError("the router closed the connection")
            self.buffer += data
        if not self.buffer.startswith(b"HTTP/1.1 200"):
            raise BenchError(f"the router answered {self.buffer[:80]!r}")
        self.buffer = self.buffer[end:]

    def close(self) -> None:
        self.sock.close()


def count_router(
    name: str,
    workers: Sequence[str],
    work: Path,
    requests: int,
    env: Mapping[str, str] | None,
    log: Log,
) -> list[Count]:
    """Every case through one router under callgrind, and the idle window after them."""
    port = free_port()
    out = work / f"callgrind-{name}"
    command = [
        find_valgrind(),
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        *python_module("router.cli", "serve", "--port", str(port), "--log-level", "warning"),
        *QUIET_FLAGS,
        *(arg for url in workers for arg in ("--worker", url)),
    ]
    proc = start(f"callgrind-{name}", command, work, {"PYTHONHASHSEED": "0", **(env or {})})
    try:
        client = _connect(proc, port)
        try:
            for case in CASES:
                with paced(workers, case.pace_ms):
                    for _ in range(max(1, WARMUP_REQUESTS // case.share)):
                        client.exchange(request_bytes(case.body))
            log(f"{name}: counting {requests} requests of each case (paced: 1 in 10)")
            windows: list[float] = []
            for case in CASES:
                wire = request_bytes(case.body)
                with paced(workers, case.pace_ms):
                    if not windows:
                        _control(proc, "-i", "on")
                    else:
                        _control(proc, "-d")  # what came between the windows: not counted
                    began = time.monotonic()
                    for _ in range(max(1, requests // case.share)):
                        client.exchange(wire)
                    _control(proc, "-d")
                    windows.append(time.monotonic() - began)
            began = time.monotonic()
            time.sleep(IDLE_S)
            _control(proc, "-d")
            idle_s = time.monotonic() - began
            _control(proc, "-i", "off")
        finally:
            client.close()
    finally:
        proc.stop()
    parts = _parts(out)
    # Parts: each case's window (the ones between them, of setting the pace, ignored),
    # then the idle window.
    numbers = [1 + 2 * position for position in range(len(CASES))]
    idle_part = numbers[-1] + 1
    if not all(number in parts for number in (*numbers, idle_part)):
        raise BenchError(f"{name}: callgrind wrote parts {sorted(parts)}, not one per window")
    idle_per_s = parts[idle_part] / idle_s
    return [
        Count(case.name, max(1, requests // case.share), parts[number], window, idle_per_s)
        for case, number, window in zip(CASES, numbers, windows, strict=True)
    ]


@contextmanager
def paced(workers: Sequence[str], pace_ms: float) -> Iterator[None]:
    """The fleet's workers at `pace_ms` between tokens while inside (nothing for 0)."""
    if not pace_ms:
        yield
        return
    with httpx.Client(timeout=10.0) as http:
        for url in workers:
            http.post(url + "/debug/behaviour", json={"token_latency_ms": pace_ms})
        try:
            yield
        finally:
            for url in workers:
                http.post(url + "/debug/behaviour", json={"token_latency_ms": 0})


def _connect(proc: Proc, port: int) -> Client:
    deadline = time.monotonic() + START_S
    while True:
        try:
            return Client(port)
        except OSError:
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{proc.name} did not start\n{proc.log_text()[-2000:]}") from None
            time.sleep(0.2)


def _control(proc: Proc, *args: str) -> None:
    done = subprocess.run(
        ["callgrind_control", *args, str(proc.pid)], capture_output=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"callgrind_control {' '.join(args)}: {done.stderr.decode()[-300:]}")


def _parts(out: Path) -> dict[int, int]:
    """Each dump's number and its instruction total (the final dump at exit is part 0
    when nothing else numbered it, and ignored)."""
    parts: dict[int, int] = {}
    for path in out.parent.glob(out.name + "*"):
        data = path.read_bytes()
        part = _PART.search(data)
        totals = _TOTALS.findall(data)
        if part is not None and totals:
            parts[int(part.group(1))] = max(int(total) for total in totals)
        path.unlink()
    return parts


def run(
    work: Path,
    requests: int,
    baseline: Baseline | None,
    log: Log,
    ours_env: Mapping[str, str] | None = None,
) -> str:
    """Count `ours` (and `ours-base` with a baseline) side by side; the table as Markdown.
    `ours_env`: where `ours` imports `router` from (the compiled build's tree); by default
    this checkout's sources."""
    if requests < 1:
        raise BenchError("--requests must be at least 1")
    find_valgrind()
    fleet: list[Proc] = []
    urls: list[str] = []
    try:
        for number in range(2):
            proc = start(
                f"fake-worker-{number}",
                python_module("router.cli", "fake-worker", "--port", "0"),
                work,
            )
            fleet.append(proc)
            (url,) = proc.wait_for_log(r"fake-worker listening on (http://\S+)")
            urls.append(url)
        # Both import `router` the same way (from PYTHONPATH, no working directory first):
        # started from the checkout instead, ours counted 0.35 % fewer in an A/A.
        ours = (
            ours_env if ours_env is not None else {"PYTHONPATH": str(REPO), "PYTHONSAFEPATH": "1"}
        )
        routers: list[tuple[str, Mapping[str, str] | None]] = [("ours", ours)]
        if baseline is not None:
            routers.append(("ours-base", baseline.env))
        counts = {name: count_router(name, urls, work, requests, env, log) for name, env in routers}
    finally:
        for proc in fleet:
            proc.stop()
    return table(counts, baseline)


def table(counts: Mapping[str, list[Count]], baseline: Baseline | None) -> str:
    names = list(counts)
    head = "| case | " + " | ".join(f"{name}, instructions per request" for name in names)
    rule = "|---|" + "--:|" * len(names)
    if baseline is not None:
        head += " | ours / ours-base"
        rule += "--:|"
    lines = [head + " |", rule]
    for position, case in enumerate(CASES):
        row = [counts[name][position] for name in names]
        cells = [f"{count.per_request:,.0f}" for count in row]
        if baseline is not None:
            cells.append(f"{row[0].per_request / row[1].per_request:.4f}")
        lines.append(f"| {case.name}, c=1 | " + " | ".join(cells) + " |")
    ours = counts[names[0]][0]
    paced_count = counts[names[0]][-1]
    lines.append("")
    lines.append(
        f"{ours.requests} requests of each case ({paced_count.requests} paced streams, "
        f"{STREAM_EVENTS} events {PACED_TOKEN_MS:g} ms apart: divide by {STREAM_EVENTS} for "
        "an event), one at a time over one keep-alive connection (after "
        f"{WARMUP_REQUESTS} of each unmeasured); idle work taken off at "
        f"{ours.idle_per_s:,.0f} instructions per second of wall time"
        + (f"; ours-base: {baseline.label()}" if baseline is not None else "")
        + "."
    )
    return "\n".join(lines)


def main_entry(
    work: Path,
    requests: int,
    baseline: Baseline | None,
    log: Log,
    ours_env: Mapping[str, str] | None = None,
) -> int:
    try:
        print(run(work, requests, baseline, log, ours_env))
    except BenchError as exc:
        print(f"python -m bench --instructions: {exc}", file=sys.stderr)
        return 1
    return 0

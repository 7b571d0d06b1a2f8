"""`python -m bench.ramp`: what a burst of fresh connections costs, the start of a c=256 round.

256 new client connections each send one unary request at once, and each request's time
from its send to its whole answer is taken (a plain `selectors` client, one thread: the
same for every contender). Contenders: ours; ours keeping idle upstream connections 60 s
(`--pool-idle-expiry-s 60`), so that its rounds after the first find the ones the round
before opened, as smg's do; smg. Rounds are `--gap` seconds apart per contender (more
than ours' 4 s idle expiry by default, as between two `make bench` rounds). Figures go
to stdout as a Markdown table: per round, the median and the slowest of the 256.
"""

from __future__ import annotations

import argparse
import re
import selectors
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.baseline import compiled_env
from bench.plan import CASES, CONTENDERS, Contender
from bench.procs import raise_nofile_limit
from bench.run import CHAT_PATH, Bench
from bench.wrk import find_wrk

KEPT_IDLE = "ours-idle60"
NAMES = ("ours", KEPT_IDLE, "smg")
CONNECTIONS = 256
TIMEOUT_S = 10.0
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


def _answered(data: bytes) -> bool:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    length = _CONTENT_LENGTH.search(data, 0, end + 2)
    if length is None:
        raise RuntimeError(f"an answer without content-length: {data[:200]!r}")
    return len(data) >= end + 4 + int(length.group(1))


def ramp(port: int, body: bytes, connections: int = CONNECTIONS) -> list[float]:
    """Each connection's request-to-answer time in ms, sorted; every connection opened at
    once, each sending its request as soon as it is connected."""
    request = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    selector = selectors.DefaultSelector()
    sent: dict[int, float] = {}
    times: list[float] = []
    received: dict[int, bytes] = {}
    socks = []
    try:
        for index in range(connections):
            sock = socket.socket()
            socks.append(sock)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect_ex(("127.0.0.1", port))
            selector.register(sock, selectors.EVENT_WRITE, index)
        deadline = time.monotonic() + TIMEOUT_S
        while len(times) < connections:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{connections - len(times)} requests unanswered")
            for key, _ in selector.select(1.0):
                index = key.data
                sock = socks[index]
                if index not in sent:
                    sock.sendall(request)  # a few hundred bytes into an empty buffer
                    sent[index] = time.perf_counter()
                    received[index] = b""
                    selector.modify(sock, selectors.EVENT_READ, index)
                    continue
                data = sock.recv(65536)
                if not data:
                    raise RuntimeError("a connection closed before its answer")
                received[index] += data
                if _answered(received[index]):
                    times.append((time.perf_counter() - sent[index]) * 1000)
                    selector.unregister(sock)
    finally:
        for sock in socks:
            sock.close()
        selector.close()
    return sorted(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ramp", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gap", type=float, default=5.0, help="seconds before each round")
    parser.add_argument("--compiled-tree", type=Path, help="run ours from this compiled build")
    args = parser.parse_args(argv)
    CONTENDERS[KEPT_IDLE] = Contender(
        KEPT_IDLE, "router serve --pool-idle-expiry-s 60", ("--pool-idle-expiry-s", "60")
    )
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    body = CASES["unary-c256"].body
    results: dict[str, list[list[float]]] = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        bench = Bench(Path(work), find_wrk(), 2, log, raise_nofile_limit())
        if args.compiled_tree is not None:
            bench.ours_env = compiled_env(args.compiled_tree)
        try:
            bench.start_fleet()
            bench.start_contenders(list(NAMES))
            for round_ in range(args.rounds):
                for name in NAMES:
                    time.sleep(args.gap)
                    port = int(bench.targets[name].url.rsplit(":", 1)[1])
                    times = ramp(port, body)
                    results[name].append(times)
                    log(f"round {round_} {name}: median {statistics.median(times):.1f} ms")
        finally:
            bench.close()
    print(
        f"| {CONNECTIONS} fresh connections, one request each | median per round (ms) | slowest per round (ms) |"
    )
    print("|---|---|---|")
    for name in NAMES:
        medians = ", ".join(f"{statistics.median(times):.1f}" for times in results[name])
        slowest = ", ".join(f"{times[-1]:.1f}" for times in results[name])
        print(f"| {name} | {medians} | {slowest} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

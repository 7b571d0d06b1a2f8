"""Fuzz the client edge: hostile request bytes into a real router on loopback in front of a
fake worker.

Properties, for every example: no answer is a 500 and nothing follows an answer that
closed the connection; the router logs no error (a connection task that failed, a handler
that raised); afterwards no lease is left (every worker's in-flight count is 0) and a
normal request is answered 200.

The router and its worker run in a thread of their own (one `trio.run` for the whole
module) and each example talks to it with a plain blocking socket, so an example costs
milliseconds, not a router start. Examples: `ROUTER_FUZZ_EXAMPLES` (200 by default;
`make fuzz` runs 10,000).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.adversarial.support import CHAT, CHAT_BODY, open_setup, statuses

EXAMPLES = int(os.environ.get("ROUTER_FUZZ_EXAMPLES", "200"))
# Short timeouts, yet long enough for the checks' own requests on a loaded machine (the
# router runs on real sockets and the wall clock).
ROUTER_SETTINGS = {
    "header_timeout_s": 1.0,
    "body_timeout_s": 1.0,
    "idle_timeout_s": 0.05,
    "max_body_bytes": 4096,
    "max_buffered_body_bytes": 16384,
    "client_write_timeout_s": 2.0,
}
_READ_TIMEOUT_S = 5.0
# A client that keeps its side open reads for this long at most, then closes: what the
# router does at its own deadlines is tested in test_client_slow.py.
_KEEP_OPEN_S = 0.3


@dataclass
class FuzzTarget:
    port: int
    errors: list[logging.LogRecord]
    # One client for the whole module (building one costs a tenth of a second); a fresh
    # connection per request, as the router closes idle ones within 50 ms.
    http: httpx.Client


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def target() -> Iterator[FuzzTarget]:
    """A router and its fake worker, served by a thread until the module's tests end."""
    ports: queue.Queue[int | BaseException] = queue.Queue()
    stop: list[tuple[trio.lowlevel.TrioToken, trio.Event]] = []

    async def host() -> None:
        done = trio.Event()
        stop.append((trio.lowlevel.current_trio_token(), done))
        async with open_setup(**ROUTER_SETTINGS) as setup:  # type: ignore[arg-type]
            ports.put(setup.port)
            await done.wait()

    def run() -> None:
        try:
            trio.run(host)
        except BaseException as exc:  # handed to the test thread, which raises it
            ports.put(exc)

    errors = _ErrorRecords()
    logging.getLogger("router").addHandler(errors)
    thread = threading.Thread(target=run, name="fuzzed-router")
    thread.start()
    try:
        started = ports.get(timeout=30)
        if isinstance(started, BaseException):
            raise started
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=f"http://127.0.0.1:{started}", limits=limits, timeout=5) as http:
            yield FuzzTarget(started, errors.records, http)
    finally:
        if stop:
            token, done = stop[0]
            trio.from_thread.run_sync(done.set, trio_token=token)
        thread.join(timeout=30)
        logging.getLogger("router").removeHandler(errors)
    assert not thread.is_alive()


def _request(head: list[bytes], body: bytes, *, version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"POST /v1/chat/completions "
        + version
        + b"\r\n"
        + b"".join(line + b"\r\n" for line in head)
        + b"\r\n"
        + body
    )


_BASE_HEAD = [b"Host: router", b"Content-Type: application/json"]
VALID = [
    _request([*_BASE_HEAD, b"Content-Length: %d" % len(CHAT_BODY)], CHAT_BODY),
    _request(
        [*_BASE_HEAD, b"Transfer-Encoding: chunked"],
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY),
    ),
    _request(
        [*_BASE_HEAD, b"Expect: 100-continue", b"Content-Length: %d" % len(CHAT_BODY)], CHAT_BODY
    ),
    _request([b"Content-Length: %d" % len(CHAT_BODY)], CHAT_BODY, version=b"HTTP/1.0"),
    b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n",
    b"HEAD /v1/models HTTP/1.1\r\nHost: router\r\n\r\n",
    b"GET /v1/workers HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n",
]
NASTY_LINES = [
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: chunked, identity",
    b"Transfer-Encoding: \x00chunked",
    b"Content-Length: 0",
    b"Content-Length: 5, 6",
    b"Content-Length: -1",
    b"Content-Length: 99999999999999999999999",
    b"Content-Length: 1e3",
    b" folded",
    b"\tfolded",
    b"X-A: a\rb",
    b"X-A: \x00",
    b"X-\x00: a",
    b"Host: second",
    b"Connection: close",
    b"Connection: keep-alive, upgrade",
    b"Upgrade: h2c",
    b"Expect: 100-continue",
    b"Expect: nonsense",
    b"X-Big: " + b"a" * 70_000,
    b":",
    b"NoColon",
    b"X-Router-Worker: http://evil",
    b"Content-Type: text/plain",
]


@st.composite
def hostile_bytes(draw: st.DrawFn) -> list[bytes]:
    """Pieces to send one after another: a mutated or assembled request, maybe pipelined."""
    kind = draw(st.sampled_from(["mutated", "assembled", "pipelined", "random"]))
    if kind == "random":
        data = draw(st.binary(max_size=512))
    elif kind == "assembled":
        head = [*_BASE_HEAD, *draw(st.lists(st.sampled_from(NASTY_LINES), max_size=4))]
        head += draw(st.lists(st.binary(max_size=40), max_size=2))
        body = draw(st.sampled_from([b"", CHAT_BODY, b"0\r\n\r\n", b"5;x\r\nhello\r\n0\r\n\r\n"]))
        draw(st.randoms()).shuffle(head)
        data = _request(head, body, version=draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"])))
    else:
        data = draw(st.sampled_from(VALID))
        for _ in range(draw(st.integers(0 if kind == "pipelined" else 1, 4))):
            at = draw(st.integers(0, len(data)))
            op = draw(st.sampled_from(["flip", "insert", "delete", "line"]))
            if op == "flip" and at < len(data):
                data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
            elif op == "insert":
                data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
            elif op == "delete":
                data = data[:at] + data[at + draw(st.integers(1, 8)) :]
            else:
                line_at = data.find(b"\r\n")
                data = (
                    data[: line_at + 2]
                    + draw(st.sampled_from(NASTY_LINES))
                    + b"\r\n"
                    + data[line_at + 2 :]
                )
        if kind == "pipelined":
            data += draw(st.sampled_from(VALID))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if b > a]


def _exchange(port: int, pieces: list[bytes], half_close: bool) -> bytes:
    """Send `pieces` on a fresh connection, then half-close it or not; what came back until
    the router closed it (half-closed: within `_READ_TIMEOUT_S`, else the test fails), or
    for `_KEEP_OPEN_S` when the client keeps its side open."""
    timeout = _READ_TIMEOUT_S if half_close else _KEEP_OPEN_S
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the router may close first, having refused what it read
        received = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                if half_close:
                    raise
                break
            if not chunk:
                break
            received.append(chunk)
        return b"".join(received)


def _settle(http: httpx.Client) -> None:
    """Wait until the example's connection is gone (the scrape's own is the only one left)
    and no lease is left (in-flight 0 everywhere)."""
    deadline = time.monotonic() + 5.0  # wall-clock: the router runs in another thread
    while True:
        workers = http.get("/v1/workers").json()["workers"]
        metrics = http.get("/metrics").text
        if (
            all(worker["inflight"] == 0 for worker in workers)
            and "\nrouter_client_connections 1.0\n" in metrics
        ):
            return
        assert time.monotonic() < deadline, f"leases or connections left: {workers}"
        time.sleep(0.01)  # polls another thread's counters; the deadline above bounds it


def _still_serving(http: httpx.Client) -> None:
    """A normal request is answered."""
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Half-closed after sending, or not: then an incomplete request waits for the router's
# own timeouts.
@given(pieces=hostile_bytes(), half_close=st.booleans())
def test_client_bytes_never_cause_a_500_a_crash_or_a_leak(
    target: FuzzTarget, pieces: list[bytes], half_close: bool
) -> None:
    target.errors.clear()
    answer = _exchange(target.port, pieces, half_close)
    found = statuses(answer)
    assert 500 not in found, answer[:300]
    assert -1 not in found, answer[:300]
    _settle(target.http)
    assert not target.errors, [record.getMessage() for record in target.errors]
    _still_serving(target.http)

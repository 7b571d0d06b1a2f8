"""What tracing costs a request: the calls the request path makes, off and on.

`python -m bench.tracing_cost` runs, per simulated request, exactly the tracing calls a
mixed request with one attempt makes (begin, enter, attempt, inject, answered, verdict,
end, leave, end) and prints microseconds per request, best of several repeats:
- off: `--otlp-traces-endpoint` unset, the do-nothing objects;
- on: the OpenTelemetry SDK with its batch processor, exporting over OTLP/HTTP to a
  local sink that answers 200 (the export itself runs in the SDK's thread and is not in
  the figure; its CPU is).

A whole request through the router costs about 250 us of CPU on the reference machine
(docs/performance.md), so the off figure is put beside that. Wall-clock timings on a
shared machine are noisy: compare figures from one run only.
"""

from __future__ import annotations

import argparse
import http.server
import threading
import time
from collections.abc import Callable, Sequence

import trio

from router.fleet.breaker import Outcome
from router.fleet.records import WorkerRecord
from router.fleet.registry import Worker
from router.http.server.messages import Request
from router.observability.tracing import OtlpTracing, Tracing, current_trace, otel_installed

ROUTER_US_PER_REQUEST = 250.0
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"bench-1")]


class _NullWriter:
    started = False

    async def respond(self, *args: object) -> None: ...

    async def start(self, *args: object) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def finish(self) -> None: ...

    async def abort(self, *, reset: bool = False) -> None: ...


def one_request(tracing: Tracing, worker: Worker) -> None:
    request = Request("POST", "/v1/chat/completions", list(HEADERS))
    trace, _writer = tracing.begin(request, _NullWriter())
    token = tracing.enter(trace)
    attempt = current_trace().attempt(worker)
    attempt.inject(list(HEADERS))
    attempt.answered(200)
    attempt.verdict(Outcome.SUCCESS)
    attempt.end()
    tracing.leave(token)
    trace.end(200)


def measure(step: Callable[[], None], iterations: int, repeats: int) -> float:
    """Best microseconds per call of `step` over `repeats` runs of `iterations`."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        best = min(best, (time.perf_counter() - start) / iterations * 1e6)
    return best


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tracing_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--iterations", type=int, default=2000, help="simulated requests per repeat (default 2000)"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="repeats; the best counts (default 7)"
    )
    args = parser.parse_args(argv)
    worker = Worker(WorkerRecord(id="w", url="http://127.0.0.1:1", models=("m",)))

    def off() -> None:
        one_request(Tracing(), worker)

    baseline = measure(
        lambda: Request("POST", "/v1/chat/completions", list(HEADERS)),
        args.iterations,
        args.repeats,
    )
    off_us = max(0.0, measure(off, args.iterations, args.repeats) - baseline)
    print(
        f"tracing off: {off_us:.2f} us per request ({off_us / ROUTER_US_PER_REQUEST:.2%} of ~{ROUTER_US_PER_REQUEST:g} us)"
    )
    if not otel_installed():
        print("tracing on: not measured (pip install 'trio-router[otel]')")
        return 0
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    tracing = OtlpTracing(f"http://127.0.0.1:{sink.server_address[1]}/v1/traces")
    # Fewer requests: each makes two spans, and past the SDK's queue (2048) spans are
    # dropped, which would measure the drop path instead.
    on_iterations = min(args.iterations, 2000 // (2 * args.repeats))
    on_us = max(
        0.0, measure(lambda: one_request(tracing, worker), on_iterations, args.repeats) - baseline
    )
    print(
        f"tracing on:  {on_us:.2f} us per request ({on_us / ROUTER_US_PER_REQUEST:.2%} of ~{ROUTER_US_PER_REQUEST:g} us)"
    )
    trio.run(tracing.aclose)
    sink.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

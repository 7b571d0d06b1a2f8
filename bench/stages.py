"""`python -m bench --stages`: the router's CPU per request, stage by stage.

Each stage is the router's own code for that stage, run in this process on the bytes of a
typical unary request (micro-benchmarks: the best of several timed loops, so a loaded
machine inflates the figures less than it does a whole run). What no micro-benchmark
isolates (trio's scheduling, the socket calls, the handler's glue) is the rest of a
measured whole: a short `wrk` run at unary c=32 through `ours`, its CPU-seconds divided by
its requests, minus the stages. Also measured: the request and response parsers the
issue weighed (h11 and httptools on the client edge; upstream, the hand-written parser
before and llhttp behind our checks now, for a head and for one chunk of an SSE stream).
"""

from __future__ import annotations

import importlib.util
import timeit
from collections.abc import Callable
from dataclasses import dataclass

import h11
import orjson
from prometheus_client import CollectorRegistry

from bench.upstream_before import HandWrittenChunked, parse_head_by_hand
from router.fleet.breaker import BreakerSettings, CircuitBreaker, Outcome
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.http.server.messages import Request
from router.http.server.request_parser import RequestParser
from router.http.server.response_framing import encode_head, request_keeps_alive
from router.http.upstream.parser import UpstreamParser
from router.http.upstream.request_encoding import encode_request
from router.observability.metrics import RouterMetrics
from router.observability.request_id import forget, identify
from router.pipeline.resolve import parse_generation_request
from router.policies.policy import PolicyKey
from router.policies.simple import RoundRobin

BODY = orjson.dumps(
    {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say hello to the benchmark, briefly."}],
        "max_tokens": 16,
    }
)
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"Content-Type: application/json\r\nUser-Agent: wrk\r\nContent-Length: %d\r\n\r\n%s"
    % (len(BODY), BODY)
)
ANSWER_BODY = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "bench-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}}],
    }
)
RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"date: Mon, 30 Nov 2026 12:00:00 GMT\r\nserver: fake-worker" % len(ANSWER_BODY)
)
RESPONSE = RESPONSE_HEAD + b"\r\n\r\n" + ANSWER_BODY
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\ndate: Mon, 30 Nov 2026 12:00:00 GMT\r\nserver: fake-worker\r\n\r\n"
)
# One chunk of a paced stream: one SSE event (~200 bytes) per read.
SSE_EVENT = (
    b"data: "
    + orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1764504000,
            "model": "bench-model",
            "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
        }
    )
    + b"\n\n"
)
SSE_CHUNK = b"%x\r\n" % len(SSE_EVENT) + SSE_EVENT + b"\r\n"
LOOPS = 2000
REPEATS = 5


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    what: str
    run: Callable[[], object]


def best_us(run: Callable[[], object], loops: int = LOOPS) -> float:
    """Microseconds per call: the best of `REPEATS` timed loops."""
    return min(timeit.repeat(run, number=loops, repeat=REPEATS)) / loops * 1e6


def _parse_with_h11() -> object:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
    conn.receive_data(REQUEST)
    head = conn.next_event()
    data = conn.next_event()
    conn.next_event()
    return head, data


def _parse_with_llhttp() -> object:
    parser = RequestParser(65536, 1 << 20)
    parser.receive_data(REQUEST)
    return parser.next_event(), parser.next_event(), parser.next_event()


def _make_request() -> Request:
    return Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
        body=BODY,
    )


def _selection() -> Callable[[], object]:
    record = WorkerRecord(id="w0", url="http://127.0.0.1:1", models=("bench-model",))
    workers = [
        Worker(
            WorkerRecord(id=f"w{i}", url=f"http://127.0.0.1:{i + 1}", models=("bench-model",)),
            breaker=CircuitBreaker(BreakerSettings(), name=f"w{i}"),
        )
        for i in range(4)
    ]
    del record
    policy = RoundRobin()
    key = PolicyKey(model="bench-model", role=Role.MIXED)

    def run() -> object:
        worker = policy.pick(key, workers)
        breaker = worker.breaker
        assert breaker is not None
        permit = breaker.acquire(1.0)
        assert permit is not None
        breaker.record(permit, Outcome.SUCCESS, 1.0)
        return worker

    return run


def _metrics() -> Callable[[], object]:
    requests = RouterMetrics(Fleet(), CollectorRegistry()).requests

    def run() -> object:
        requests.count_request("bench-model", "chat", 200)
        requests.observe_duration("chat", 0.004)
        requests.observe_ttfb("chat", 0.002)
        return requests

    return run


def _request_id() -> object:
    _, token = identify(_make_request())
    forget(token)
    return token


def _relay() -> object:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"0123456789abcdef")]
    head = encode_head(
        200,
        [
            *headers,
            (b"content-length", b"%d" % len(ANSWER_BODY)),
            (b"server", b"r"),
            (b"date", b"d"),
        ],
        b"OK",
        method="POST",
        http_version=b"1.1",
        request_keep_alive=request_keeps_alive(b"1.1", headers),
    )
    return head.data + ANSWER_BODY


def _upstream_parse() -> object:
    end = RESPONSE.find(b"\r\n\r\n") + 4
    return UpstreamParser().parse_head(RESPONSE[:end])


def _upstream_parse_by_hand() -> object:
    end = RESPONSE.find(b"\r\n\r\n")
    return parse_head_by_hand(RESPONSE[:end])


def _sse_chunk_with_llhttp() -> Callable[[], object]:
    parser = UpstreamParser()
    parser.parse_head(STREAM_HEAD)
    parser.expect_chunked()

    def run() -> object:
        data = parser.feed_chunked(SSE_CHUNK)
        assert data == SSE_EVENT
        return data

    return run


def _sse_chunk_by_hand() -> Callable[[], object]:
    decoder = HandWrittenChunked()

    def run() -> object:
        data = decoder.take(SSE_CHUNK)
        assert data == SSE_EVENT
        return data

    return run


def stages() -> list[Stage]:
    return [
        Stage(
            "accept and parse",
            "RequestParser (llhttp): a fresh parser, the head and the body",
            _parse_with_llhttp,
        ),
        Stage(
            "JSON decode",
            "parse_generation_request (orjson and the shape checks)",
            lambda: parse_generation_request("/v1/chat/completions", BODY, ["bench-model"]),
        ),
        Stage(
            "selection and breaker", "round robin over 4, breaker acquire and record", _selection()
        ),
        Stage(
            "upstream write",
            "encode_request (head checked, one join)",
            lambda: encode_request(
                "POST",
                "/v1/chat/completions",
                b"127.0.0.1:1",
                [(b"content-type", b"application/json")],
                BODY,
            ),
        ),
        Stage(
            "upstream parse",
            "head end found, UpstreamParser.parse_head (llhttp behind our checks)",
            _upstream_parse,
        ),
        Stage(
            "relay to the client", "encode_head (grammar, framing, keep-alive) and the body", _relay
        ),
        Stage(
            "metrics",
            "requests counter, duration and ttfb histograms (labels per call)",
            _metrics(),
        ),
        Stage("logging", "request id chosen, set for the log context, reset", _request_id),
    ]


def parser_figures() -> list[tuple[str, float | None]]:
    """The request and response parsers weighed for each edge; None where not installed."""
    figures: list[tuple[str, float | None]] = [
        ("request, h11 (the server edge before)", best_us(_parse_with_h11)),
        (
            "request, RequestParser (llhttp framed by us: the server edge now)",
            best_us(_parse_with_llhttp),
        ),
        (
            "response head, hand-written (the upstream edge before)",
            best_us(_upstream_parse_by_hand),
        ),
        (
            "response head, UpstreamParser (llhttp behind our checks: the upstream edge now)",
            best_us(_upstream_parse),
        ),
        ("SSE chunk of ~200 bytes, hand-written decoder (before)", best_us(_sse_chunk_by_hand())),
        (
            "SSE chunk of ~200 bytes, UpstreamParser.feed_chunked (llhttp: now)",
            best_us(_sse_chunk_with_llhttp()),
        ),
    ]
    if importlib.util.find_spec("httptools") is None:
        figures += [("request, httptools", None), ("response, httptools", None)]
        return figures
    import httptools

    class _Sink:
        def on_header(self, name: bytes, value: bytes) -> None:
            pass

        def on_body(self, body: bytes) -> None:
            pass

    sink = _Sink()

    def request_with_httptools() -> object:
        parser = httptools.HttpRequestParser(sink)
        parser.feed_data(REQUEST)
        return parser

    def response_with_httptools() -> object:
        parser = httptools.HttpResponseParser(sink)
        parser.feed_data(RESPONSE)
        return parser

    figures += [
        (
            "request, bare httptools (a fresh parser, callbacks doing nothing)",
            best_us(request_with_httptools),
        ),
        (
            "response, bare httptools (a fresh parser, head and body, callbacks doing nothing)",
            best_us(response_with_httptools),
        ),
    ]
    return figures


def stage_table(total_us: float | None) -> str:
    """The stage table in Markdown; `total_us`: measured router CPU per request, if any."""
    rows = ["| Stage | What is measured | us per request |", "|---|---|---|"]
    summed = 0.0
    for stage in stages():
        us = best_us(stage.run)
        summed += us
        rows.append(f"| {stage.name} | {stage.what} | {us:.1f} |")
    rows.append(f"| sum of the stages | | {summed:.1f} |")
    if total_us is not None:
        rows.append(
            f"| the rest: trio's scheduling, socket calls, the handler's glue | whole minus stages | {total_us - summed:.1f} |"
        )
        rows.append(
            f"| whole (unary c=32 through `ours`) | router CPU-seconds / requests | {total_us:.1f} |"
        )
    rows += ["", "| Parser | us per message |", "|---|---|"]
    for name, us in parser_figures():
        rows.append(f"| {name} | {'not installed' if us is None else f'{us:.1f}'} |")
    return "\n".join(rows)

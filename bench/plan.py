"""What is measured: the cases (request shape and concurrency) and the contenders."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

MODEL = "fake-model"
# A chat stream carries the role event, one event per token, the finish event and [DONE].
STREAM_EVENTS = 20
STREAM_TOKENS = STREAM_EVENTS - 3
UNARY_TOKENS = 16
PACED_TOKEN_MS = 1.0


def chat_body(*, stream: bool, tokens: int, ignore_eos: bool = False) -> bytes:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": tokens,
        "stream": stream,
    }
    if ignore_eos:
        # A real engine stops at its end-of-sequence token; this makes it generate them all.
        body["ignore_eos"] = True
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class Case:
    """One load shape: the body, how many connections, and the fleet's pace meanwhile."""

    name: str
    title: str
    connections: int
    stream: bool
    token_latency_ms: float = 0.0
    ignore_eos: bool = False

    @property
    def body(self) -> bytes:
        tokens = STREAM_TOKENS if self.stream else UNARY_TOKENS
        return chat_body(stream=self.stream, tokens=tokens, ignore_eos=self.ignore_eos)

    @property
    def events(self) -> int:
        """SSE events per response (0 for unary)."""
        return STREAM_EVENTS if self.stream else 0


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("unary-c1", "unary, c=1", 1, stream=False),
        Case("unary-c32", "unary, c=32", 32, stream=False),
        Case("unary-c256", "unary, c=256", 256, stream=False),
        Case("stream-c32", f"burst stream ({STREAM_EVENTS} events), c=32", 32, stream=True),
        Case(
            "paced-c64",
            f"paced stream ({STREAM_EVENTS} events, {PACED_TOKEN_MS:g} ms apart), c=64",
            64,
            stream=True,
            token_latency_ms=PACED_TOKEN_MS,
        ),
    )
}
QUICK_CASES = ("unary-c1", "unary-c32", "paced-c64")
PROFILED_CASES = ("unary-c32", "stream-c32")
"""What `--profile` records in `ours`: the request path, and the relay loop."""


@dataclass(frozen=True, slots=True)
class Contender:
    """A way to reach the fleet. `router_flags` is None for the ones that are not our router."""

    name: str
    description: str
    router_flags: tuple[str, ...] | None = None
    processes: int = 1
    ready_timeout_s: float = 30.0


VOCABULARY = "{vocabulary}"
"""Stands in a contender's flags for the fake fleet's vocabulary file (`--kv-tokenizer`),
written where the bench works."""

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("direct", "straight to one fake worker (its CPU is the worker's)"),
        Contender("ours", "router serve, native front (trio + llhttp)", ()),
        # With `--fleet-engine vllm` the fakes stream token ids when asked: `ours-resume`
        # then captures every stream (it has the fleet's tokenizer), `ours-noresume` never
        # asks. On the default SGLang fleet both relay as `ours` does.
        Contender(
            "ours-resume",
            "router serve with the fleet's tokenizer: resumable streams captured while relayed",
            ("--kv-tokenizer", VOCABULARY),
        ),
        Contender("ours-noresume", "router serve --resume-limit 0", ("--resume-limit", "0")),
        # `--baseline REF`: the same as `ours`, run from REF's tree (bench/baseline.py).
        Contender("ours-base", "router serve as of the --baseline commit", ()),
        # `--compiled-tree PATH`: `ours` (and its variants) run the compiled build there;
        # `ours-pure` runs this checkout's sources beside it.
        Contender("ours-pure", "router serve from its Python sources (the pure build)", ()),
        # The A/B of the collector's settings (router/observability/garbage_collection.py).
        Contender(
            "ours-gc-default",
            "router serve --gc-young-threshold 0 (Python's own collector settings)",
            ("--gc-young-threshold", "0"),
        ),
        Contender(
            "ours-hypercorn",
            "router serve --server hypercorn (ASGI adapter)",
            ("--server", "hypercorn"),
        ),
        Contender(
            "ours-2proc",
            "router serve --processes 2 (SO_REUSEPORT)",
            ("--processes", "2"),
            processes=2,
        ),
        Contender("smg", "SGLang Model Gateway (Rust), round_robin"),
        # Its proxy takes about 27 s to start on an idle 2-core machine.
        Contender(
            "litellm",
            "LiteLLM proxy (Python, uvicorn), simple-shuffle, from .venv-litellm",
            ready_timeout_s=180.0,
        ),
        # Bytes relayed on trio and nothing more: what trio costs before any router work.
        Contender(
            "trio-floor",
            "bench.trio_floor: bytes relayed verbatim on trio, one upstream connection per "
            "client connection, round robin (no parse, routing, pool or metrics)",
        ),
    )
}

RESUME_CONTENDERS = ("ours-noresume", "ours-resume", "smg")
"""What `--fleet-engine vllm` runs unless told: the relay with resume capture off, on, and
the Rust gateway."""
RESUME_CASES = ("stream-c32", "paced-c64")
DEFAULT_CONTENDERS = tuple(
    name
    for name in CONTENDERS
    if name
    not in (
        "ours-resume",
        "ours-noresume",
        "ours-base",
        "ours-pure",
        "ours-gc-default",
        "trio-floor",
    )
)
"""What a run on the default fleet plays: the resume pair relays as `ours` does there."""

"""Chat and completions through the router over gRPC are the engine's own answers: a real
vLLM serving its gRPC engine service behind `router serve --worker grpc://...`, beside
the same model on vLLM's HTTP server, both greedy. For 20 prompts (10 chat, 10
completions, multi-byte text among them), streamed and unary, the router's text, finish
reason and token counts equal the HTTP server's: the router's rendering, tokenization
and detokenization are the engine's."""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import trio

from conformance.engines import Engine, EngineSettings
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import RouterProcess, open_router

MODEL = "tiny"
CALL_TIMEOUT_S = 120.0
MAX_TOKENS = 24
TEXTS = [
    "hello there",
    "tell me about the router",
    "naïve café — déjà vu",
    "東京の天気は",
    "emoji 🙂 and 🚀 together",
    "1, 2, 3, 4, 5",
    "  leading spaces and\nnew lines\n",
    "Ünïcödé everywhere: ß, ø, ł",
    "a long prompt " * 12,
    "why?",
]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": text}]} for text in TEXTS[:7]
] + [
    {
        "messages": [
            {"role": "system", "content": "You are a router."},
            {"role": "user", "content": text},
        ]
    }
    for text in TEXTS[7:]
]
COMPLETIONS: list[dict[str, Any]] = [{"prompt": text} for text in TEXTS]
CASES = [("/v1/chat/completions", body) for body in CHATS] + [
    ("/v1/completions", body) for body in COMPLETIONS
]


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    yield from host_engines(
        [
            EngineSettings(served_model_name=MODEL),
            EngineSettings(served_model_name=MODEL, protocol="grpc"),
        ],
        name="grpc-tokens",
    )


@pytest.fixture
async def router(host: EngineHost) -> AsyncIterator[RouterProcess]:
    grpc_engine = _engine(host, "grpc")
    async with open_router("--worker", f"{grpc_engine.url},model={MODEL}") as running:
        yield running


def _engine(host: EngineHost, protocol: str) -> Engine:
    (engine,) = [e for e in host.engines if e.url.startswith(protocol + "://")]
    return engine


async def _answer(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Any:
    """What a client reads of one answer: per choice its text, finish reason, and the
    completion tokens; streamed bodies are joined from their deltas."""
    response = await client.post(url + path, json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, choice["finish_reason"], data["usage"]["completion_tokens"]
    text, finish, tokens = "", None, None
    for block in response.text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        event = orjson.loads(block.removeprefix("data: "))
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"]:
            piece = choice.get("delta", {}).get("content") if "delta" in choice else choice["text"]
            text += piece or ""
            finish = choice.get("finish_reason") or finish
    assert response.text.rstrip().endswith("data: [DONE]")
    return text, finish, tokens


Reader = Callable[[httpx.AsyncClient, str, str, dict[str, Any]], Awaitable[Any]]


async def _differences(
    engine_url: str,
    router_url: str,
    requests: list[tuple[str, dict[str, Any], dict[str, Any]]],
    read: Reader,
    same: Callable[[Any, Any], bool],
) -> tuple[list[str], int]:
    """Each request (path, the case's body, the body sent) to the engine's HTTP server and
    to the router: what differs (or is empty), and how many items were compared."""
    differ: list[str] = []
    compared = 0
    with trio.fail_after(CALL_TIMEOUT_S * 4):
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as client:
            for path, body, request in requests:
                direct = await read(client, engine_url, path, request)
                ours = await read(client, router_url, path, request)
                compared += len(direct)
                if not direct or not same(ours, direct):
                    differ.append(f"{path} {body}:\n  engine {direct!r}\n  router {ours!r}")
    return differ, compared


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_over_grpc_the_answers_are_the_engines_own(
    host: EngineHost, router: RouterProcess, stream: bool
) -> None:
    extra: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS}
    if stream:
        extra |= {"stream": True, "stream_options": {"include_usage": True}}
    requests = [(path, body, {**body, **extra}) for path, body in CASES]
    differ, _ = await _differences(
        _engine(host, "http").url, router.url, requests, _answer, operator.eq
    )
    assert differ == [], "\n".join(differ) + "\n" + router.log()


LOGPROB_TOLERANCE = 1e-3
"""Two engine processes of the same model on CPU: the same floats, give or take rounding."""
LOGPROB_CASES = [CASES[0], CASES[3], CASES[4], CASES[10], CASES[12], CASES[14]]
"""Chat and completions, multi-byte text among them."""


def _logprob_entries(path: str, logprobs: Any) -> list[tuple[str, float, list[Any], Any]]:
    """One choice's logprobs, per token: its text, logprob, alternatives and offset."""
    if path == "/v1/chat/completions":
        return [
            (
                entry["token"],
                entry["logprob"],
                [(t["token"], t["logprob"], t["bytes"]) for t in entry["top_logprobs"]],
                entry["bytes"],
            )
            for entry in logprobs["content"]
        ]
    return [
        (token, logprob, sorted(top.items()), offset)
        for token, logprob, top, offset in zip(
            logprobs["tokens"],
            logprobs["token_logprobs"],
            logprobs["top_logprobs"],
            logprobs["text_offset"],
            strict=True,
        )
    ]


async def _logprobs(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Any:
    """The first choice's logprob entries, joined over a stream's chunks."""
    response = await client.post(url + path, json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return _logprob_entries(path, response.json()["choices"][0]["logprobs"])
    entries = []
    for block in response.text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        for choice in orjson.loads(block.removeprefix("data: "))["choices"]:
            if choice.get("logprobs"):
                entries += _logprob_entries(path, choice["logprobs"])
    return entries


def _close(ours: Any, theirs: Any) -> bool:
    """Equal, floats within LOGPROB_TOLERANCE."""
    if isinstance(ours, float) and isinstance(theirs, float):
        return abs(ours - theirs) <= LOGPROB_TOLERANCE
    if isinstance(ours, list | tuple) and isinstance(theirs, list | tuple):
        return len(ours) == len(theirs) and all(map(_close, ours, theirs))
    return bool(ours == theirs)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_over_grpc_the_logprobs_are_the_engines_own(
    host: EngineHost, router: RouterProcess, stream: bool
) -> None:
    extra: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS}
    if stream:
        extra["stream"] = True
    requests = [
        (
            path,
            body,
            {
                **body,
                **extra,
                **(
                    {"logprobs": True, "top_logprobs": 3}
                    if path == "/v1/chat/completions"
                    else {"logprobs": 3}
                ),
            },
        )
        for path, body in LOGPROB_CASES
    ]
    differ, tokens = await _differences(
        _engine(host, "http").url, router.url, requests, _logprobs, _close
    )
    print(f"logprobs {'streamed' if stream else 'unary'}: {tokens} tokens compared")
    assert differ == [], "\n".join(differ) + "\n" + router.log()

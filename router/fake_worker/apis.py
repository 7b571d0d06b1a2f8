"""The generation APIs of a fake engine side by side: which path speaks which API, and the
one place that picks an API's parser, answer, stream frames and error shape.

Chat, completions and `/generate` live in `formats`, the Responses API in
`responses_api`, Anthropic Messages in `anthropic_api`; the engine only calls these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from router.fake_worker.anthropic_api import MessageFrames, message_body, parse_message_request
from router.fake_worker.behaviour import Behaviour
from router.fake_worker.formats import Api, Generation, StreamFrames, parse_generation, unary_body
from router.fake_worker.responses_api import ResponseFrames, parse_response_request, response_body
from router.fake_worker.stats import RankLoad

GENERATION_PATHS = {
    "/v1/chat/completions": Api.CHAT,
    "/v1/completions": Api.COMPLETIONS,
    "/generate": Api.GENERATE,
    "/v1/responses": Api.RESPONSES,
    "/v1/messages": Api.MESSAGES,
}
REQUEST_ID_PREFIX = {
    Api.CHAT: "chatcmpl-fake-",
    Api.COMPLETIONS: "cmpl-fake-",
    Api.GENERATE: "fake-",
    Api.RESPONSES: "resp_fake-",
    Api.MESSAGES: "msg_fake-",
}


class Frames(Protocol):
    """A stream's events: `head()`, `token(i, choice)` per token and choice, `tail()`."""

    @property
    def gen(self) -> Generation: ...

    def head(self) -> list[bytes]: ...

    def token(self, i: int, choice: int = 0) -> bytes: ...

    def tail(self) -> list[bytes]: ...


def parse_request(
    api: Api,
    body: Any,
    default_tokens: int,
    default_model: str,
    *,
    max_model_len: int | None = None,
) -> Generation:
    """Raises `BadGenerationRequest` for what the engine of `api` rejects; `max_model_len`
    applies vLLM's token-limit rules to chat and completions (see `parse_generation`)."""
    if api is Api.RESPONSES:
        return parse_response_request(body, default_tokens, default_model)
    if api is Api.MESSAGES:
        return parse_message_request(body, default_model)
    return parse_generation(api, body, default_tokens, default_model, max_model_len=max_model_len)


def render_unary(gen: Generation, request_id: str, created: int, *, vllm: bool = False) -> bytes:
    """`vllm`: chat and completions carry vLLM's own keys too."""
    if gen.api is Api.RESPONSES:
        return response_body(gen, request_id, created)
    if gen.api is Api.MESSAGES:
        return message_body(gen, request_id)
    return unary_body(gen, request_id, created, vllm=vllm)


def stream_frames(gen: Generation, request_id: str, created: int, *, vllm: bool = False) -> Frames:
    """`vllm`: chat and completions events carry vLLM's own keys too."""
    if gen.api is Api.RESPONSES:
        return ResponseFrames(gen, request_id, created)
    if gen.api is Api.MESSAGES:
        return MessageFrames(gen, request_id)
    return StreamFrames(gen, request_id, created, vllm=vllm)


def paced_events(frames: Frames, behaviour: Behaviour, load: RankLoad) -> Iterator[bytes | float]:
    """The stream's events in order, with a float (seconds to sleep) wherever the pace needs a
    pause: the time to first token, then the latency between tokens. Counts the tokens into
    `load` as they are taken."""
    gen = frames.gen
    ttft_s = behaviour.ttft_ms / 1000 + gen.prefill_s
    between_s = behaviour.token_latency_ms / 1000
    if ttft_s > 0:
        yield ttft_s
    yield from frames.head()
    for i in range(gen.tokens):
        if i and between_s > 0:
            yield between_s
        for choice in range(gen.n):
            yield frames.token(i, choice)
        load.generation_tokens += gen.n
    yield from frames.tail()

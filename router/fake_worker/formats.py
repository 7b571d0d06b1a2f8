"""The three generation APIs a fake worker speaks, as data: parse a request, render answers.

OpenAI chat (`/v1/chat/completions`), OpenAI completions (`/v1/completions`) and SGLang's
native `/generate`. Generation is fake and checkable: token `i` is the text `tok{i} `, so
`expected_text(n)` is exactly what a request for `n` tokens gets back, per choice.
Nothing here blocks or keeps state; pacing and failures belong to the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

from router.fake_worker.behaviour import MAX_TOKENS

MAX_CHOICES = 128

_TOKEN_TABLE = [f"tok{i} ".encode() for i in range(4096)]


def token_bytes(i: int) -> bytes:
    """The text of generated token `i`, as UTF-8 (plain ASCII: safe inside a JSON string)."""
    if i < len(_TOKEN_TABLE):
        return _TOKEN_TABLE[i]
    return f"tok{i} ".encode()


def expected_text(tokens: int) -> str:
    """The full text a choice of `tokens` tokens carries."""
    return "".join(f"tok{i} " for i in range(tokens))


def count_words(text: str) -> int:
    """The fake tokenizer: one prompt token per whitespace-separated word."""
    return len(text.split())


def content_words(content: Any) -> int:
    """Words of a message's content: a string, or the text parts of a list of parts
    (OpenAI content parts, Anthropic content blocks, Responses input parts alike)."""
    if isinstance(content, str):
        return count_words(content)
    if not isinstance(content, list):
        return 0
    return sum(
        count_words(part["text"])
        for part in content
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    )


class Api(enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    GENERATE = "generate"
    RESPONSES = "responses"  # router/fake_worker/responses_api.py
    MESSAGES = "messages"  # router/fake_worker/anthropic_api.py


class BadGenerationRequest(ValueError):
    """The request body cannot be served; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One parsed generation request: what to produce and how to frame it."""

    api: Api
    model: str
    stream: bool
    tokens: int  # per choice
    explicit_limit: bool  # the client set the limit, so finishing at it is "length"
    n: int
    prompt_tokens: int
    include_usage: bool
    cached_tokens: int | None = None  # None: no prefix cache, so none is reported (as SGLang)
    prefill_s: float = 0.0  # time the uncached part of the prompt takes before the first token

    @property
    def finish_reason(self) -> str:
        return "length" if self.explicit_limit else "stop"

    @property
    def completion_tokens(self) -> int:
        return self.tokens * self.n


def parse_generation(api: Api, body: Any, default_tokens: int, default_model: str) -> Generation:
    """Validate a decoded JSON body; raise `BadGenerationRequest` for what an engine rejects."""
    if not isinstance(body, dict):
        raise BadGenerationRequest("the request body must be a JSON object")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        model = default_model
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadGenerationRequest("'stream' must be true or false")
    if api is Api.GENERATE:
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadGenerationRequest("'sampling_params' must be an object")
        limit = params.get("max_new_tokens")
        prompt = _generate_prompt_tokens(body)
        n = 1
    else:
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if api is Api.CHAT:
            prompt = _chat_prompt_tokens(body.get("messages"))
        else:
            prompt = _completion_prompt_tokens(body.get("prompt"))
        n = body.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise BadGenerationRequest(f"'n' must be an integer between 1 and {MAX_CHOICES}")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_TOKENS
    ):
        raise BadGenerationRequest(f"the token limit must be an integer between 0 and {MAX_TOKENS}")
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return Generation(
        api=api,
        model=model,
        stream=stream,
        tokens=default_tokens if limit is None else limit,
        explicit_limit=limit is not None,
        n=n,
        prompt_tokens=prompt,
        include_usage=include_usage,
    )


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadGenerationRequest("'messages' must be a non-empty list")
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            raise BadGenerationRequest("each message must be an object")
        total += content_words(message.get("content"))
    return total


def _completion_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return count_words(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)  # already token ids
        if all(isinstance(item, str) for item in prompt):
            return sum(count_words(item) for item in prompt)
    raise BadGenerationRequest(
        "'prompt' must be a string, a list of strings or a list of token ids"
    )


def _generate_prompt_tokens(body: dict[str, Any]) -> int:
    text = body.get("text")
    if isinstance(text, str):
        return count_words(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and all(isinstance(item, int) for item in ids):
        return len(ids)
    raise BadGenerationRequest("/generate needs 'text' (a string) or 'input_ids' (token ids)")


def usage(gen: Generation) -> dict[str, Any]:
    counts: dict[str, Any] = {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }
    if gen.cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
    return counts


def unary_body(gen: Generation, request_id: str, created: int) -> bytes:
    """The whole answer of a non-streaming request."""
    text = expected_text(gen.tokens)
    if gen.api is Api.GENERATE:
        return orjson.dumps({"text": text, "meta_info": _meta_info(gen, request_id, gen.tokens)})
    if gen.api is Api.CHAT:
        obj = "chat.completion"
        choices: list[dict[str, Any]] = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
            for i in range(gen.n)
        ]
    else:
        obj = "text_completion"
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
            for i in range(gen.n)
        ]
    return orjson.dumps(
        {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": gen.model,
            "choices": choices,
            "usage": usage(gen),
        }
    )


def _meta_info(gen: Generation, request_id: str, done: int) -> dict[str, Any]:
    finish: dict[str, Any] | None = None
    if done == gen.tokens:
        finish = (
            {"type": "length", "length": gen.tokens}
            if gen.explicit_limit
            else {"type": "stop", "matched": None}
        )
    return {
        "id": request_id,
        "finish_reason": finish,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": done,
        "cached_tokens": gen.cached_tokens or 0,
    }


DONE = b"data: [DONE]\n\n"


class StreamFrames:
    """The SSE events of one streaming answer, in order: `head()`, `token(i, choice)` for
    each token, then `tail()`. Per-token events are byte templates filled with the token."""

    def __init__(self, gen: Generation, request_id: str, created: int) -> None:
        self.gen = gen
        self.request_id = request_id
        self.created = created
        if gen.api is Api.GENERATE:
            self._prefix = b""
            self._infix = b""
            self._suffix = b""
            return
        obj = b"chat.completion.chunk" if gen.api is Api.CHAT else b"text_completion"
        self._prefix = (
            b'data: {"id":'
            + orjson.dumps(request_id)
            + b',"object":"'
            + obj
            + b'","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(gen.model)
            + b',"choices":[{"index":'
        )
        if gen.api is Api.CHAT:
            self._infix = b',"delta":{"content":"'
            self._suffix = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._infix = b',"text":"'
            self._suffix = b'","logprobs":null,"finish_reason":null}]}\n\n'

    def head(self) -> list[bytes]:
        """Events before the first token: the assistant role, for chat."""
        if self.gen.api is not Api.CHAT:
            return []
        return [
            self._event(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(self.gen.n)
                ]
            )
        ]

    def token(self, i: int, choice: int = 0) -> bytes:
        if self.gen.api is Api.GENERATE:
            # SGLang streams the text so far, not the delta.
            text = expected_text(i + 1)
            meta = _meta_info(self.gen, self.request_id, i + 1)
            return b"data: " + orjson.dumps({"text": text, "meta_info": meta}) + b"\n\n"
        return self._prefix + str(choice).encode() + self._infix + token_bytes(i) + self._suffix

    def tail(self) -> list[bytes]:
        """Events after the last token: finish reasons, the usage chunk, `[DONE]`."""
        gen = self.gen
        if gen.api is Api.GENERATE:
            frames = []
            if gen.tokens == 0:
                meta = _meta_info(gen, self.request_id, 0)
                frames.append(b"data: " + orjson.dumps({"text": "", "meta_info": meta}) + b"\n\n")
            return [*frames, DONE]
        finals: list[dict[str, Any]]
        if gen.api is Api.CHAT:
            finals = [
                {"index": i, "delta": {}, "logprobs": None, "finish_reason": gen.finish_reason}
                for i in range(gen.n)
            ]
        else:
            finals = [
                {"index": i, "text": "", "logprobs": None, "finish_reason": gen.finish_reason}
                for i in range(gen.n)
            ]
        frames = [self._event(finals)]
        if gen.include_usage:
            frames.append(self._event([], usage(gen)))
        frames.append(DONE)
        return frames

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.gen.api is Api.CHAT else "text_completion",
            "created": self.created,
            "model": self.gen.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

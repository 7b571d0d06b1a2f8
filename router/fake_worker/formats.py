"""The three generation APIs a fake worker speaks, as data: parse a request, render answers.

OpenAI chat (`/v1/chat/completions`), OpenAI completions (`/v1/completions`) and SGLang's
native `/generate`. Generation is fake and checkable: token `i` is the text `tok{i} `, so
`expected_text(n)` is exactly what a request for `n` tokens gets back, per choice. A
prompt of ids that ends with tokens the fake generates goes on from there
(`router.fake_worker.vocabulary`), and vLLM's `return_token_ids` streams the ids.
Nothing here blocks or keeps state; pacing and failures belong to the engine.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import orjson

from router.fake_worker.behaviour import MAX_TOKENS
from router.fake_worker.vocabulary import first_token, is_token_ids, word_ids

MAX_CHOICES = 128
SYSTEM_FINGERPRINT = "vllm-0.0.0+fake"

# vLLM's extensions of the OpenAI answers, null unless a request asks for them (token ids,
# prompt logprobs, PD transfer parameters, ...): the fake never has anything to put there.
_VLLM_CHAT_TOP = {
    "service_tier": None,
    "system_fingerprint": SYSTEM_FINGERPRINT,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "prompt_text": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_VLLM_COMPLETION_TOP = {
    "service_tier": None,
    "system_fingerprint": SYSTEM_FINGERPRINT,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_VLLM_CHAT_CHOICE = {"stop_reason": None, "token_ids": None, "routed_experts": None}
_VLLM_COMPLETION_CHOICE = {
    "stop_reason": None,
    "token_ids": None,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "routed_experts": None,
}
_VLLM_MESSAGE = {
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "reasoning": None,
}

_TOKEN_TABLE = [f"tok{i} ".encode() for i in range(4096)]


def token_bytes(i: int) -> bytes:
    """The text of generated token `i`, as UTF-8 (plain ASCII: safe inside a JSON string)."""
    if i < len(_TOKEN_TABLE):
        return _TOKEN_TABLE[i]
    return f"tok{i} ".encode()


def expected_text(tokens: int, first: int = 0) -> str:
    """The full text a choice of `tokens` tokens carries (from token `first` on)."""
    return "".join(f"tok{i} " for i in range(first, first + tokens))


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
    """The request body cannot be served; the message says which field and why.

    `param` names the field (`body.<field>` when the body's shape is wrong, the field
    itself when its value is refused), and `refused` tells the two apart: vLLM answers a
    shape its request schema rejects with `type: "Bad Request"`, a value its sampling
    checks refuse with `type: "BadRequestError"`.
    """

    def __init__(self, message: str, *, param: str | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.refused = refused


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
    first: int = 0
    """The first generated token (`vocabulary.first_token`): above 0 for a prompt of ids
    that ends with tokens the fake generates, which it goes on from."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's ids when the request asks for token ids (`return_token_ids`, which
    vLLM answers and SGLang's chat and completions ignore); None otherwise."""

    @property
    def reemitted(self) -> str:
        """Text the first delta carries before the first token's: a prompt of ids that ends
        with generated tokens has them decoded again, as vLLM's streaming detokenizer
        re-emits part of a prompt of ids (vLLM #48853)."""
        return expected_text(self.first) if self.first else ""

    deltas: tuple[str, ...] | None = None
    """With stop strings: each token's text as vLLM streams it (`stop_deltas`)."""
    tail_text: str = ""
    """With stop strings: the text held back until the finish event carries it."""
    stop_reason: str | None = None
    """The stop string the answer ended at, if it did."""

    @property
    def finish_reason(self) -> str:
        if self.stop_reason is not None:
            return "stop"
        return "length" if self.explicit_limit else "stop"

    def text(self) -> str:
        """The whole text of a choice."""
        if self.deltas is not None:
            return "".join(self.deltas) + self.tail_text
        return self.reemitted + expected_text(self.tokens, self.first)

    @property
    def completion_tokens(self) -> int:
        return self.tokens * self.n


def parse_generation(
    api: Api,
    body: Any,
    default_tokens: int,
    default_model: str,
    *,
    max_model_len: int | None = None,
) -> Generation:
    """Validate a decoded JSON body; raise `BadGenerationRequest` for what an engine rejects.

    With `max_model_len` (vLLM's rules) a token limit must lie in `[1, max_model_len]`,
    as vLLM's sampling checks demand; without it (SGLang) any limit up to `MAX_TOKENS`,
    0 included, is served.
    """
    if not isinstance(body, dict):
        raise BadGenerationRequest("the request body must be a JSON object", param="body")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        model = default_model
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadGenerationRequest("'stream' must be true or false", param="body.stream")
    limit_field = "max_tokens"
    if api is Api.GENERATE:
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadGenerationRequest(
                "'sampling_params' must be an object", param="body.sampling_params"
            )
        limit_field = "max_new_tokens"
        limit = params.get(limit_field)
        prompt = _generate_prompt_tokens(body)
        n = 1
    else:
        if body.get("max_completion_tokens") is not None:
            limit_field = "max_completion_tokens"
        limit = body.get(limit_field)
        if api is Api.CHAT:
            prompt = _chat_prompt_tokens(body.get("messages"))
        else:
            prompt = _completion_prompt_tokens(body.get("prompt"))
        n = body.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise BadGenerationRequest(
                f"'n' must be an integer between 1 and {MAX_CHOICES}", param="body.n"
            )
    if limit is not None:
        _check_limit(limit_field, limit, max_model_len)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    ids = _prompt_ids(api, body)
    if ids is not None:
        prompt = len(ids)
    prompt_ids: tuple[int, ...] | None = None
    if api is not Api.GENERATE and body.get("return_token_ids") is True:
        prompt_ids = tuple(ids if ids is not None else word_ids(_prompt_words(api, body)))
    gen = Generation(
        api=api,
        model=model,
        stream=stream,
        tokens=default_tokens if limit is None else limit,
        explicit_limit=limit is not None,
        n=n,
        prompt_tokens=prompt,
        include_usage=include_usage,
        first=first_token(ids) if ids is not None else 0,
        prompt_ids=prompt_ids,
    )
    stops = body.get("stop")
    if isinstance(stops, str):
        stops = [stops]
    if api is not Api.GENERATE and isinstance(stops, list) and any(stops):
        gen = stop_deltas(
            gen,
            [s for s in stops if isinstance(s, str) and s],
            body.get("include_stop_str_in_output") is True,
        )
    return gen


def stop_deltas(gen: Generation, stops: list[str], include: bool) -> Generation:
    """`gen` ending where vLLM ends it on a stop string: the text cut before the first stop
    string that completes (after it, with `include`), no token after the one completing
    it, and each token's delta holding back the last `len(longest stop) - 1` characters
    (they could begin a stop string) until the finish event."""
    held = max(len(s) for s in stops) - 1 if not include else 0
    text, sent = "", 0
    deltas: list[str] = []
    for i in range(gen.tokens):
        before = len(text)
        text += f"tok{gen.first + i} "
        found = [
            (text.find(s, max(0, before - len(s) + 1)), s)
            for s in stops
            if text.find(s, max(0, before - len(s) + 1)) >= 0
        ]
        if found:
            start, stop = min(found, key=lambda hit: hit[0] + len(hit[1]))
            text = text[: start + len(stop)] if include else text[:start]
            deltas.append("")
            return dataclasses.replace(
                gen, tokens=i + 1, deltas=(*deltas,), tail_text=text[sent:], stop_reason=stop
            )
        end = max(sent, len(text) - held)
        deltas.append(text[sent:end])
        sent = end
    return dataclasses.replace(gen, deltas=(*deltas,), tail_text=text[sent:])


def _prompt_ids(api: Api, body: dict[str, Any]) -> list[int] | None:
    """The prompt when it comes as token ids (a completions prompt of ids; chat's
    `kv_transfer_params.prompt_token_ids`, which vLLM takes in place of rendering the
    messages), else None. Raises BadGenerationRequest for chat ids vLLM refuses."""
    if api is Api.COMPLETIONS:
        prompt = body.get("prompt")
        return prompt if is_token_ids(prompt) else None
    if api is not Api.CHAT:
        return None
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("prompt_token_ids") is None:
        return None
    ids = params["prompt_token_ids"]
    if not is_token_ids(ids):
        raise BadGenerationRequest(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
            "non-negative integers.",
            param="kv_transfer_params.prompt_token_ids",
            refused=True,
        )
    return list(ids)


def _prompt_words(api: Api, body: dict[str, Any]) -> str:
    """The words the fake tokenizes a text prompt into: the completions prompt, or the
    text of every chat message."""
    if api is Api.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return " ".join(p for p in prompt if isinstance(p, str))
        return prompt if isinstance(prompt, str) else ""
    words: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words.append(content)
        elif isinstance(content, list):
            words.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return " ".join(words)


def _check_limit(field: str, limit: Any, max_model_len: int | None) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise BadGenerationRequest(f"'{field}' must be an integer", param=f"body.{field}")
    if max_model_len is None:
        if not 0 <= limit <= MAX_TOKENS:
            raise BadGenerationRequest(
                f"the token limit must be an integer between 0 and {MAX_TOKENS}",
                param=f"body.{field}",
            )
        return
    # vLLM's own words (its SamplingParams and tokenization checks).
    if limit < 1:
        message = f"{field} must be at least 1, got {limit}."
    elif limit > max_model_len:
        message = (
            f"{field}={limit} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens."
        )
    else:
        return
    raise BadGenerationRequest(
        f"{message} (parameter={field}, value={limit})", param=field, refused=True
    )


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadGenerationRequest("'messages' must be a non-empty list", param="body.messages")
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            raise BadGenerationRequest("each message must be an object", param="body.messages")
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
        "'prompt' must be a string, a list of strings or a list of token ids", param="body.prompt"
    )


def _generate_prompt_tokens(body: dict[str, Any]) -> int:
    text = body.get("text")
    if isinstance(text, str):
        return count_words(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and all(isinstance(item, int) for item in ids):
        return len(ids)
    raise BadGenerationRequest(
        "/generate needs 'text' (a string) or 'input_ids' (token ids)", param="body.text"
    )


def usage(gen: Generation, *, details: bool = False) -> dict[str, Any]:
    """The token counts; `details` (vLLM's unary answers) adds both `*_details`, null when
    there is nothing to say."""
    counts: dict[str, Any] = {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }
    if gen.cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
    elif details:
        counts["prompt_tokens_details"] = None
    if details:
        counts["completion_tokens_details"] = None
    return counts


def unary_body(gen: Generation, request_id: str, created: int, *, vllm: bool = False) -> bytes:
    """The whole answer of a non-streaming request; `vllm` adds vLLM's own keys."""
    text = gen.text()
    if gen.api is Api.GENERATE:
        return orjson.dumps({"text": text, "meta_info": _meta_info(gen, request_id, gen.tokens)})
    if gen.api is Api.CHAT:
        obj = "chat.completion"
        message = {"role": "assistant", "content": text, **(_VLLM_MESSAGE if vllm else {})}
        choices: list[dict[str, Any]] = [
            {
                "index": i,
                "message": message,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                **(_VLLM_CHAT_CHOICE if vllm else {}),
            }
            for i in range(gen.n)
        ]
        extra = _VLLM_CHAT_TOP
    else:
        obj = "text_completion"
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                **(_VLLM_COMPLETION_CHOICE if vllm else {}),
            }
            for i in range(gen.n)
        ]
        extra = _VLLM_COMPLETION_TOP
    return orjson.dumps(
        {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": gen.model,
            "choices": choices,
            "usage": usage(gen, details=vllm),
            **(extra if vllm else {}),
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
    each token, then `tail()`. Per-token events are byte templates filled with the token.

    Each event carries one choice, as both engines send them: with `n` above 1 a role
    event per choice, the choices' tokens interleaved, a finish event per choice.
    `vllm` adds vLLM's own keys (null) and its `system_fingerprint` on the last event
    before `[DONE]`; with token ids asked for (`gen.prompt_ids`), vLLM's `token_ids` of
    each event and `prompt_token_ids` on a choice's first event (chat: the role event).
    """

    def __init__(
        self, gen: Generation, request_id: str, created: int, *, vllm: bool = False
    ) -> None:
        self.gen = gen
        self.request_id = request_id
        self.created = created
        self.vllm = vllm
        self.ids = vllm and gen.prompt_ids is not None
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
        extra = b""
        if gen.api is Api.CHAT:
            if vllm:
                extra = b',"token_ids":null'
            self._infix = b',"delta":{"content":"'
            self._suffix = b'"},"logprobs":null,"finish_reason":null' + extra + b"}]}\n\n"
        else:
            if vllm:
                extra = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null'
            self._infix = b',"text":"'
            self._suffix = b'","logprobs":null,"finish_reason":null' + extra + b"}]}\n\n"

    def head(self) -> list[bytes]:
        """Events before the first token: the assistant role, for chat."""
        if self.gen.api is not Api.CHAT:
            return []
        extra: dict[str, Any] | None = None
        if self.vllm:
            prompt_ids = list(self.gen.prompt_ids) if self.ids and self.gen.prompt_ids else None
            extra = {"prompt_token_ids": prompt_ids, "prompt_text": None}
        return [
            self._event(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                extra=extra,
            )
            for i in range(self.gen.n)
        ]

    def token(self, i: int, choice: int = 0) -> bytes:
        gen = self.gen
        if gen.api is Api.GENERATE:
            # SGLang streams the text so far, not the delta.
            meta = _meta_info(gen, self.request_id, i + 1)
            return (
                b"data: "
                + orjson.dumps({"text": expected_text(i + 1), "meta_info": meta})
                + b"\n\n"
            )
        token = gen.first + i
        text = token_bytes(token) if gen.deltas is None else gen.deltas[i].encode()
        if i == 0 and gen.first:
            text = gen.reemitted.encode() + text
        suffix = self._suffix
        if self.ids:
            ids = b"[" + str(token).encode() + b"]"
            suffix = suffix.replace(b'"token_ids":null', b'"token_ids":' + ids)
            if i == 0 and gen.api is Api.COMPLETIONS and gen.prompt_ids is not None:
                prompt = orjson.dumps(list(gen.prompt_ids))
                suffix = suffix.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":' + prompt)
        return self._prefix + str(choice).encode() + self._infix + text + suffix

    def tail(self) -> list[bytes]:
        """Events after the last token: finish reasons, the usage chunk, `[DONE]`."""
        gen = self.gen
        if gen.api is Api.GENERATE:
            frames = []
            if gen.tokens == 0:
                meta = _meta_info(gen, self.request_id, 0)
                frames.append(b"data: " + orjson.dumps({"text": "", "meta_info": meta}) + b"\n\n")
            return [*frames, DONE]
        vllm = self.vllm
        finals: list[dict[str, Any]]
        if gen.api is Api.CHAT:
            finals = [
                {
                    "index": i,
                    "delta": {"content": gen.tail_text} if vllm or gen.tail_text else {},
                    "logprobs": None,
                    "finish_reason": gen.finish_reason,
                    **(
                        {"stop_reason": gen.stop_reason, "token_ids": [] if self.ids else None}
                        if vllm
                        else {}
                    ),
                }
                for i in range(gen.n)
            ]
        else:
            finals = [
                {
                    "index": i,
                    "text": gen.tail_text,
                    "logprobs": None,
                    "finish_reason": gen.finish_reason,
                    **(
                        {
                            "stop_reason": gen.stop_reason,
                            "prompt_token_ids": None,
                            "token_ids": [] if self.ids else None,
                        }
                        if vllm
                        else {}
                    ),
                }
                for i in range(gen.n)
            ]
        fingerprint = {"system_fingerprint": SYSTEM_FINGERPRINT} if vllm else None
        frames = [
            self._event(
                [final],
                extra=fingerprint if i == gen.n - 1 and not gen.include_usage else None,
            )
            for i, final in enumerate(finals)
        ]
        if gen.include_usage:
            frames.append(self._event([], usage(gen), extra=fingerprint))
        frames.append(DONE)
        return frames

    def _event(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.gen.api is Api.CHAT else "text_completion",
            "created": self.created,
            "model": self.gen.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        if extra:
            chunk.update(extra)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

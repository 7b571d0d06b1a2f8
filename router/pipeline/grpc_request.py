"""What a `grpc://` worker is sent: an OpenAI chat, completions or Responses body, an
Anthropic Messages body, or SGLang's `/generate` body, as vLLM's `GenerateRequest` (token ids, sampling parameters), and what
the gRPC path cannot do.

The router renders and tokenizes the prompt itself (`router.prompts`) and maps the
body's sampling fields onto the engine's `SamplingParams` as vLLM's OpenAI server maps
them, with its defaults: completions generate 16 tokens unless `max_tokens` says
otherwise; chat up to the context; special tokens skipped and spaced. A Messages body
maps as vLLM's Anthropic endpoint maps it (`stop_sequences` are stop strings); a
`/generate` body's `sampling_params` as SGLang reads them (`max_new_tokens`, default 128).

`grpc_gap` names what the path does not do, before any worker is picked: tool calls,
structured output, prompt logprobs and logprobs outside chat and completions, multimodal content (and Messages' tool and thinking
blocks), Responses' `previous_response_id` and non-message items, `echo` and `suffix`,
batched prompts, `/generate`'s logprobs, images and LoRA, and every route but chat,
completions, Messages, Responses and `/generate`. A request with a gap goes to an HTTP worker of
its model when one exists, else is refused with a 400 that names the gap; it is never
answered without what it asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from router.api.errors import BadRequest
from router.pipeline.resolve import GenerationRequest

GRPC_ROUTES: Final = frozenset({"chat", "completions", "messages", "responses", "generate"})
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16
"""vLLM's `CompletionRequest.max_tokens` default (chat has none: the context's rest)."""
GENERATE_DEFAULT_MAX_NEW_TOKENS: Final = 128
"""SGLang's `max_new_tokens` default for `/generate`."""

# Fields that ask for structured output (vLLM's names, old and new).
_STRUCTURED: Final = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_FLOATS: Final = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def grpc_gap(generation: GenerationRequest) -> str | None:
    """What of this request the gRPC path does not do, in words for the client; None
    when it does all of it."""
    route = generation.route
    if route not in GRPC_ROUTES:
        return f"the {generation.path} route"
    body = generation.body
    tools = body.get("tools")
    if tools and body.get("tool_choice") != "none":
        return "tool calls (`tools`)"
    if body.get("functions"):
        return "function calls (`functions`)"
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return "structured output (`response_format`)"
    for name in _STRUCTURED:
        if body.get(name) is not None:
            return f"structured output (`{name}`)"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs (`prompt_logprobs`)"
    if route not in ("chat", "completions") and (body.get("logprobs") or body.get("top_logprobs")):
        return "logprobs"
    if route == "generate":
        for name in ("return_logprob", "image_data", "lora_path", "input_embeds"):
            if body.get(name):
                return f"`{name}`"
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
            return "batched prompts"
        return None
    if route == "completions":
        if body.get("echo"):
            return "`echo`"
        if body.get("suffix"):
            return "`suffix`"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                return "batched prompts"
    else:
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, list):
                for part in content:
                    kind = part.get("type") if isinstance(part, Mapping) else None
                    if kind != "text":
                        return f"a `{kind}` content part"
    if route == "responses":
        if body.get("previous_response_id") is not None:
            return "`previous_response_id` (the router keeps no responses)"
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, Mapping) else None
        if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
            return "structured output (`text.format`)"
        items = body.get("input")
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type", "message")
            if kind != "message":
                return f"a `{kind}` input item"
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                part_kind = part.get("type") if isinstance(part, Mapping) else None
                if part_kind not in ("input_text", "output_text", "text"):
                    return f"a `{part_kind}` content part"
    if route == "messages":
        thinking = body.get("thinking")
        if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
            return "thinking"
    best_of, n = body.get("best_of"), body.get("n")
    if isinstance(best_of, int) and best_of > (n if isinstance(n, int) else 1):
        return "`best_of`"
    return None


def completions_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The one prompt of a completions body: its text, or its token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids")


def generate_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The one prompt of a `/generate` body: its `input_ids`, else its `text`."""
    ids = body.get("input_ids")
    if isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids):
        return list(ids)
    text = body.get("text")
    if isinstance(text, str):
        return text
    raise BadRequest("'text' must be a string or 'input_ids' a list of token ids")


@dataclass(frozen=True, slots=True)
class GrpcGeneration:
    """One attempt's `GenerateRequest` and what reading its answer needs."""

    request: bytes
    request_id: str
    prompt_ids: list[int]
    n: int
    stops: tuple[str, ...]
    include_stop: bool
    min_tokens: int
    stop_ids: frozenset[int]
    """Ids that end a sequence: counted, never shown (`StreamedText.push_stop_token`)."""
    skip_special_tokens: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None = None
    """Alternatives asked for with each token's logprob; None: no logprobs."""
    extra: dict[str, Any] = field(default_factory=dict)


def build_generate(
    messages: Any,
    generation: GenerationRequest,
    prompt_ids: list[int],
    request_id: str,
    eos_ids: frozenset[int],
    rank: int | None,
) -> GrpcGeneration:
    """The `GenerateRequest` of `generation` with prompt `prompt_ids` (`messages`: the
    `vllm_engine_pb2` module). Raises BadRequest for a sampling field of the wrong type."""
    body: Mapping[str, Any] = generation.body
    if generation.route == "generate":
        # SGLang's native API: the sampling fields live in `sampling_params`.
        sampling = body.get("sampling_params")
        body = sampling if isinstance(sampling, Mapping) else {}
    params = messages.SamplingParams()
    for name in _FLOATS:
        value = _float(body, name)
        if value is not None:
            setattr(params, name, value)
    top_k = _int(body, "top_k", None)
    if top_k is not None and top_k > 0:
        params.top_k = top_k
    if generation.route == "chat":
        limit = _int(body, "max_completion_tokens", None)
        if limit is None:
            limit = _int(body, "max_tokens", None)
    elif generation.route == "messages":
        limit = _int(body, "max_tokens", None)
    elif generation.route == "responses":
        limit = _int(body, "max_output_tokens", None)
    elif generation.route == "generate":
        limit = _int(body, "max_new_tokens", GENERATE_DEFAULT_MAX_NEW_TOKENS)
    else:
        limit = _int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    if limit is not None:
        params.max_tokens = limit
    min_name = "min_new_tokens" if generation.route == "generate" else "min_tokens"
    min_tokens = _int(body, min_name, 0) or 0
    params.min_tokens = min_tokens
    stops = _stops(body, "stop_sequences" if generation.route == "messages" else "stop")
    params.stop.extend(stops)
    stop_token_ids = _ids(body, "stop_token_ids")
    params.stop_token_ids.extend(stop_token_ids)
    ignore_eos = _bool(body, "ignore_eos", False)
    params.ignore_eos = ignore_eos
    skip_special = _bool(body, "skip_special_tokens", True)
    params.skip_special_tokens = skip_special
    params.spaces_between_special_tokens = _bool(body, "spaces_between_special_tokens", True)
    include_stop = _bool(body, "include_stop_str_in_output", False)
    params.include_stop_str_in_output = include_stop
    n = _int(body, "n", 1) or 1
    params.n = n
    seed = _int(body, "seed", None)
    if seed is not None:
        params.seed = seed
    logprobs = _logprobs(generation.route, body)
    if logprobs is not None:
        params.logprobs = logprobs
    bias = body.get("logit_bias")
    if isinstance(bias, Mapping):
        try:
            for key, value in bias.items():
                params.logit_bias[int(key)] = float(value)
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' must map token ids to numbers") from None
    request = messages.GenerateRequest(
        request_id=request_id,
        tokenized=messages.TokenizedInput(input_ids=prompt_ids),
        sampling_params=params,
        stream=generation.stream,
    )
    if rank is not None:
        request.data_parallel_rank = rank
    options = body.get("stream_options")
    options = options if isinstance(options, Mapping) else {}
    stop_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else eos_ids)
    return GrpcGeneration(
        request=request.SerializeToString(),
        request_id=request_id,
        prompt_ids=prompt_ids,
        n=n,
        stops=stops,
        include_stop=include_stop,
        min_tokens=min_tokens,
        stop_ids=stop_ids,
        skip_special_tokens=skip_special,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        logprobs=logprobs,
    )


def _logprobs(route: str, body: Mapping[str, Any]) -> int | None:
    """How many alternatives to give with each generated token's logprob, as vLLM's
    OpenAI server asks its engine (chat: `top_logprobs` when `logprobs` is true;
    completions: `logprobs`); None when the body asks for none."""
    if route == "chat":
        wanted = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None)
        if top is not None and top < 0:
            raise BadRequest("'top_logprobs' must be a non-negative integer")
        if top is not None and top > 0 and not wanted:
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true")
        return (top or 0) if wanted else None
    if route == "completions":
        count = _int(body, "logprobs", None)
        if count is not None and count < 0:
            raise BadRequest("'logprobs' must be a non-negative integer")
        return count
    return None


def _float(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{name}' must be a number")
    return float(value)


def _int(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer")
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean")
    return value


def _stops(body: Mapping[str, Any], name: str) -> tuple[str, ...]:
    stop = body.get(name)
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise BadRequest(f"'{name}' must be a string or a list of strings")


def _ids(body: Mapping[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        return list(value)
    raise BadRequest(f"'{name}' must be a list of token ids")

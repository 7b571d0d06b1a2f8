"""Asking an engine for a request's token ids: the `/tokenize` body that gets exactly the
ids the engine will compute for the request, and the reading of its answer.

vLLM's `POST /tokenize` takes either `prompt` (tokenized as a completions prompt is,
special tokens added unless told otherwise) or `messages` with the chat-template
arguments (rendered as a chat request is: `add_generation_prompt` true and no special
tokens added unless told otherwise); measured on vLLM 0.32, its answer for a chat body's
messages is exactly that request's `prompt_token_ids` (docs/policies.md, "Which tokens").
SGLang's `/tokenize` takes a `prompt` only. An Anthropic Messages or a Responses body is
sent as the chat request the engine turns it into (`router.prompts.chat_from_messages`,
`chat_from_responses`); what those do not reproduce is not asked (`NotRendered`).

An answer is trusted only as a JSON object whose `tokens` are a non-empty list of
integer ids of at most `MAX_TOKENS`, agreeing with its `count` when it gives one:
anything else is a `BadTokens`, never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router.prompts.chat_from_messages import read_messages_request
from router.prompts.chat_from_responses import read_responses_request
from router.prompts.chat_request import NotRendered

MAX_TOKENS = 1 << 20
"""More ids than any context window: an answer beyond it is not a tokenization."""

# The chat fields vLLM's tokenize request shares with a chat completions request.
_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "media_io_kwargs",
    "mm_processor_kwargs",
)
# What a chat request hands its template beside its kwargs, and the tokenize request takes
# only inside `chat_template_kwargs` (vLLM 0.32's `build_chat_params` of each).
_TEMPLATE_ARGUMENTS = ("documents", "reasoning_effort")


class BadTokens(Exception):
    """An engine's `/tokenize` answer that cannot be trusted as token ids."""


def tokenize_body(model: str, body: Mapping[str, Any], route: str, engine: str | None) -> bytes:
    """The `/tokenize` body for a request on `route` (`chat`, `messages`, `responses`,
    `completions`, `generate`) to an engine of kind `engine`. Raises NotRendered when the
    engine cannot be asked for this request's ids (a chat request to an engine that takes
    only a prompt, a batch of prompts, a body of a shape the router does not convert)."""
    if route in ("chat", "messages", "responses"):
        if engine != "vllm":
            raise NotRendered("only vLLM's /tokenize renders chat messages")
        if route == "chat":
            if not isinstance(body.get("messages"), list):
                raise NotRendered("messages is not a list")
            ask = {name: body[name] for name in _CHAT_FIELDS if name in body}
            if body.get("tools") and (
                body.get("tool_choice") is not None or body.get("response_format") is not None
            ):
                # The renderer sees those beside the tools; /tokenize has no place for them.
                raise NotRendered("tools with tool_choice or response_format")
            kwargs = ask.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise NotRendered("chat_template_kwargs is not an object")
            moved = {name: body[name] for name in _TEMPLATE_ARGUMENTS if body.get(name) is not None}
            if moved:
                effort = moved.get("reasoning_effort")
                if effort is not None and "enable_thinking" not in kwargs:
                    moved["enable_thinking"] = effort != "none"
                ask["chat_template_kwargs"] = {**kwargs, **moved}
        else:
            request = (
                read_messages_request(body) if route == "messages" else read_responses_request(body)
            )
            ask = {
                "messages": list(request.messages),
                "add_generation_prompt": request.add_generation_prompt,
                "continue_final_message": request.continue_final_message,
                "add_special_tokens": request.add_special_tokens,
            }
            if isinstance(body.get("chat_template_kwargs"), dict):
                ask["chat_template_kwargs"] = body["chat_template_kwargs"]
        return orjson.dumps({"model": model, **ask})
    field = "prompt" if route == "completions" else "text"
    text = body.get(field)
    if not isinstance(text, str):
        raise NotRendered(f"{field} is not one string")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise NotRendered("add_special_tokens is not true or false")
    return orjson.dumps({"model": model, "prompt": text, "add_special_tokens": special})


def read_tokens(answer: bytes) -> list[int]:
    """The token ids of a `/tokenize` answer; BadTokens for anything else."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise BadTokens("the answer is not JSON") from None
    tokens = parsed.get("tokens") if isinstance(parsed, dict) else None
    if not isinstance(tokens, list) or not tokens:
        raise BadTokens("the answer has no list of tokens")
    if len(tokens) > MAX_TOKENS:
        raise BadTokens(f"the answer has {len(tokens)} tokens, more than any prompt")
    if not all(type(token) is int and token >= 0 for token in tokens):
        raise BadTokens("the answer's tokens are not all token ids")
    count = parsed.get("count")
    if count is not None and count != len(tokens):
        raise BadTokens(f"the answer counts {count!r} tokens and lists {len(tokens)}")
    return tokens

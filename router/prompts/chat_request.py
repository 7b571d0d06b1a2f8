"""A chat completions body read as vLLM's `ChatCompletionRequest` reads it
(`chat_completion/protocol.py` `build_chat_params` and `build_tok_params`): the messages
(still as the client sent them), the flags, the tools with vLLM's defaults filled in,
and the `chat_template_kwargs` handed to the template; `NotRendered` for a body whose
rendering the router does not reproduce."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class NotRendered(Exception):
    """The router does not render this request as the engine does."""


# What vLLM's `TokenizeParams` add for chat: the request's field, which defaults to false.
CHAT_ADDS_SPECIAL_TOKENS = False

# transformers' `apply_chat_template` parameters that change the prompt in ways the
# router does not follow (another template, tools of the client's shape, token output, a
# clash with the messages).
_REFUSED_KWARGS = frozenset(
    {
        "self",
        "conversation",
        "conversations",
        "messages",
        "tools",
        "chat_template",
        "tokenize",
        "return_assistant_tokens_mask",
    }
)
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# Top-level fields only an Anthropic Messages body has (the policy sees the body, not
# the route it came on).
_ANTHROPIC_FIELDS = ("system", "thinking", "output_config", "stop_sequences", "anthropic_version")


@dataclass(slots=True)
class ChatRequest:
    """What of a request reaches the template, before its messages are rebuilt."""

    messages: Sequence[Any]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    """The `chat_template_kwargs` vLLM hands to transformers, before its filter."""


def read_chat_request(body: Mapping[str, Any]) -> ChatRequest:
    """A chat body's request; NotRendered when the router does not render it."""
    if body.get("chat_template") is not None:
        raise NotRendered("the request brings its own chat template")
    if body.get("truncate_prompt_tokens") is not None:
        raise NotRendered("the engine truncates the prompt")
    transfer = body.get("kv_transfer_params")
    if isinstance(transfer, dict) and transfer.get("prompt_token_ids") is not None:
        raise NotRendered("the engine takes forwarded token ids")
    if any(field in body for field in _ANTHROPIC_FIELDS):
        raise NotRendered("an Anthropic Messages body")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise NotRendered("messages is not a list")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise NotRendered("add_generation_prompt and continue_final_message")
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
    }
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents
        ):
            raise NotRendered("documents of another shape")
        extra["documents"] = documents
    user = user_kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORTS:
            raise NotRendered("an unknown reasoning_effort")
        extra["reasoning_effort"] = effort
        if "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
    # ChatCompletionRequest renames a message's `reasoning_content` to `reasoning`.
    renamed = [_renamed_reasoning(m) for m in messages]
    return ChatRequest(
        renamed,
        add_generation_prompt,
        continue_final,
        _flag(body, "add_special_tokens", CHAT_ADDS_SPECIAL_TOKENS),
        _tools(body.get("tools")),
        merged_kwargs(user, extra),
    )


def _flag(body: Mapping[str, Any], field: str, default: bool) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise NotRendered(f"{field} is not a boolean")
    return value


def user_kwargs(value: Any) -> dict[str, Any]:
    """A request's `chat_template_kwargs`; NotRendered for ones the router does not
    follow."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise NotRendered("chat_template_kwargs is not an object")
    if _REFUSED_KWARGS & value.keys():
        raise NotRendered("chat_template_kwargs the router does not follow")
    return value


def merged_kwargs(user: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's merge: the request's own fields over its `chat_template_kwargs`, then the
    server's defaults under both, which drops a value of None or "auto"."""
    merged = dict(user)
    merged.update(extra)
    return {key: value for key, value in merged.items() if not _unset(value)}


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def _renamed_reasoning(message: Any) -> Any:
    if not isinstance(message, dict) or "reasoning_content" not in message:
        return message
    renamed = dict(message)
    reasoning = renamed.pop("reasoning_content")
    if reasoning is not None and renamed.get("reasoning") is None:
        renamed["reasoning"] = reasoning
    return renamed


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM hands them to the template: each validated into its
    `ChatCompletionToolsParam` and dumped (defaults filled in, unknown fields dropped)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise NotRendered("tools of another shape")
    return [_tool(tool) for tool in value]


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise NotRendered("a tool other than a function")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise NotRendered("a tool without a function name")
    description = function.get("description")
    parameters = function.get("parameters")
    strict = function.get("strict")
    defer = function.get("defer_loading")
    tool_defer = tool.get("defer_loading")
    if (
        not (description is None or isinstance(description, str))
        or not (parameters is None or isinstance(parameters, dict))
        or any(v is not None and not isinstance(v, bool) for v in (strict, defer, tool_defer))
    ):
        raise NotRendered("a tool field of another type")
    if defer is None:
        defer = tool_defer  # vLLM hands a tool's defer_loading to its function
    dumped: dict[str, Any] = {
        "name": function["name"],
        "description": description,
        "parameters": parameters,
    }
    if strict is not None:
        dumped["strict"] = strict
    if defer is not None:
        dumped["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if tool_defer is not None:
        out["defer_loading"] = tool_defer
    return out

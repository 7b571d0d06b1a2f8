"""A Responses body as the chat request vLLM makes of it (`responses/utils.py`
`construct_input_messages`, `ResponsesRequest.build_tok_params`), when its `input` is a
string or a list of plain messages (role and text content) and it has no
`previous_response_id`, `conversation`, `prompt`, tools or reasoning: `instructions`
first, as a system message, and the prompt tokenized with special tokens added."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.prompts.chat_request import ChatRequest, NotRendered, merged_kwargs, user_kwargs

# Responses never sets `TokenizeParams`' field, so its default of true applies.
RESPONSES_ADD_SPECIAL_TOKENS = True

_RESPONSES_ITEM_FIELDS = frozenset({"type", "role", "content", "status", "id"})
_RESPONSES_ROLES = frozenset({"user", "system", "developer", "assistant"})


def read_responses_request(body: Mapping[str, Any]) -> ChatRequest:
    """A Responses body's chat request; NotRendered when the router does not render it."""
    if "encoding_format" in body or "dimensions" in body:
        raise NotRendered("an embeddings body")
    for field in ("previous_response_id", "conversation", "prompt", "reasoning"):
        if body.get(field) is not None:
            raise NotRendered(f"a Responses request with {field}")
    if body.get("tools"):
        raise NotRendered("a Responses request with tools")
    if body.get("truncation", "disabled") != "disabled":
        raise NotRendered("the engine truncates the prompt")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise NotRendered("instructions that are not a string")
    value = body.get("input")
    messages: list[Any] = [{"role": "system", "content": instructions}] if instructions else []
    continue_final = False
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        messages.extend(_responses_item(item) for item in value)
        last = value[-1] if value else None
        continue_final = isinstance(last, dict) and last.get("status") in (
            "in_progress",
            "incomplete",
        )
    else:
        raise NotRendered("input of another shape")
    extra = {"add_generation_prompt": not continue_final, "continue_final_message": continue_final}
    return ChatRequest(
        messages,
        not continue_final,
        continue_final,
        RESPONSES_ADD_SPECIAL_TOKENS,
        None,
        merged_kwargs(user_kwargs(body.get("chat_template_kwargs")), extra),
    )


def _responses_item(item: Any) -> Mapping[str, Any]:
    """A Responses input message as vLLM's `construct_chat_messages_with_tool_call` makes
    it a chat message (other item types are not rendered here)."""
    if not isinstance(item, dict) or not set(item) <= _RESPONSES_ITEM_FIELDS:
        raise NotRendered("a Responses input item other than a plain message")
    role = item.get("role")
    if item.get("type", "message") != "message" or not (
        isinstance(role, str) and role in _RESPONSES_ROLES
    ):
        raise NotRendered("a Responses input item other than a plain message")
    if role != "assistant":
        if "id" in item:
            raise NotRendered("an input item the engine reads as a stored one")
        return item
    content = item.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = content[0].get("text")  # vLLM reads the first part only
    if not isinstance(content, str):
        raise NotRendered("an assistant item without text")
    return {"role": "assistant", "content": content}

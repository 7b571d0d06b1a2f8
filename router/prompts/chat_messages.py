"""A request's messages as vLLM's chat parser hands them to the template
(`renderers/chat_utils.py` `_parse_chat_message_content` and `_postprocess_messages`):
each rebuilt from what vLLM reads of it (`role`; text `content`, as a list of text parts
or joined with newlines, as the template's content format wants; `name` and `task`; an
assistant's `tool_calls`, `arguments` parsed, and `reasoning`; a tool message's
`tool_call_id`), a system message without a leading `x-anthropic-billing-header` line,
and developer messages merged into one leading system message for a template that never
names the developer role."""

from __future__ import annotations

import json
from typing import Any

from router.prompts.chat_request import NotRendered

# Content parts read as text, and the field holding their text (chat_utils'
# `MM_PARSER_MAP`); "thinking" parts are left out: an Anthropic body carries them too,
# and vLLM reads those differently.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_SKIPPED_WHEN_EMPTY = frozenset({"text", "refusal"})
# The fields of every content-part type vLLM knows (chat_utils'
# `_KNOWN_CONTENT_PART_FIELDS`); any other key of a text part reaches the template.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_BILLING_HEADER = "x-anthropic-billing-header"


def template_message(raw: Any, openai_content: bool) -> dict[str, Any]:
    """One message as vLLM's chat parser hands it to the template: its content a list of
    text parts when `openai_content`, else one string."""
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise NotRendered("a message without a role")
    role: str = raw["role"]
    content = raw.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise NotRendered("content of another type")
    if role == "system":
        parts = _without_billing_header(parts)
    # vLLM keeps what parses to something truthy: an empty string part goes, an empty
    # text part (a dict) stays.
    texts = [text for part in parts if (text := _part(part, openai_content))]
    message: dict[str, Any] = {
        "role": role,
        "content": texts if openai_content else "\n".join(texts),
    }
    if role == "assistant":
        tool_calls = raw.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise NotRendered("tool_calls is not a list")
            if tool_calls:  # an empty list is dropped
                message["tool_calls"] = [_tool_call(call) for call in tool_calls]
        reasoning = raw.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise NotRendered("reasoning is not a string")
            message["reasoning"] = reasoning
            message["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in raw:
            call_id = raw["tool_call_id"]
            if not (call_id is None or isinstance(call_id, str)):
                raise NotRendered("tool_call_id is not a string")
            message["tool_call_id"] = call_id
        if openai_content:  # a tool's text parts reach the template as one string
            message["content"] = "\n".join(part["text"] for part in texts)
    for field in ("name", "task"):
        value = raw.get(field)
        if value is not None:
            if not isinstance(value, str):
                raise NotRendered(f"{field} is not a string")
            message[field] = value
    if role == "developer":
        if raw.get("tools") is not None:
            raise NotRendered("a developer message with tools")
        message["tools"] = None
    return message


def _part(part: Any, openai_content: bool) -> Any:
    """A text part as the template gets it (a string, or a text part and its unknown
    fields); None for a part without text, which vLLM skips."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai_content else part
    if not isinstance(part, dict) or part.get("uuid") is not None:
        raise NotRendered("a content part other than text")
    kind = part.get("type")
    field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if field is None:
        raise NotRendered("a content part other than text")
    text = part.get(field)
    if text is None and kind in _SKIPPED_WHEN_EMPTY:
        return None
    if not isinstance(text, str):
        raise NotRendered("a text part without text")
    if not openai_content:
        return text
    wrapped: dict[str, Any] = {"type": "text", "text": text}
    wrapped.update((k, v) for k, v in part.items() if k not in _KNOWN_PART_FIELDS)
    return wrapped


def _without_billing_header(parts: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _tool_call(call: Any) -> dict[str, Any]:
    """An assistant's tool call as validated (fields in the schema's order, unknown ones
    after) and post-processed by vLLM: `arguments` parsed to an object, `{}` when it
    is empty, not JSON or not an object."""
    if not isinstance(call, dict) or call.get("type") != "function":
        raise NotRendered("a tool call other than a function")
    function = call.get("function")
    if (
        not isinstance(call.get("id"), str)
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or not isinstance(function.get("arguments"), str)
    ):
        raise NotRendered("a tool call of another shape")
    arguments: Any = {}
    if function["arguments"]:
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = {}
        except RecursionError:
            raise NotRendered("tool call arguments nested too deep") from None
        if not isinstance(arguments, dict):
            arguments = {}
    called = {"arguments": arguments, "name": function["name"]}
    called.update((k, v) for k, v in function.items() if k not in ("arguments", "name"))
    out: dict[str, Any] = {"id": call["id"], "function": called, "type": "function"}
    out.update((k, v) for k, v in call.items() if k not in ("id", "function", "type"))
    return out


def with_developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's handling of developer messages for a template that never names the role:
    each becomes a system message, then the system messages are merged into one, first,
    when one is not first."""
    return _merge_system([_as_system(m) if m["role"] == "developer" else m for m in conversation])


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    converted = {**message, "role": "system"}
    converted.pop("tools", None)
    return converted


def _merge_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's merge of every system message into one, first, when one is not first."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        if index > 0 or contents:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if (isinstance(part, dict) and "text" in part) or isinstance(part, str)
            )
        if content:
            contents.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]

"""What the policies read of a request: the routing key `consistent_hash` hashes (a
session, else the prompt's start), and the whole prompt `cache_aware` matches, rendered once.

The whole prompt (`routing_text`):

Rendering is append-friendly: a conversation that grows by whole messages keeps the
rendering of its earlier turns as a prefix, which is what a KV cache reuses.

- chat (and Anthropic Messages, its `system` first as a `system` message; and the
  Responses API's `input` given as a list): every message as `role` + newline + its text
  + newline, in order; the text of a message is its string content, or the text parts of
  a multimodal content list joined (images and other parts carry no text and are left
  out); a Responses `input` string is the text itself;
- completions: the prompt string; a batch of strings joined, one per line;
- `/generate`: `text` (a batch joined, one per line), else `input_ids` as decimal ids each
  followed by a comma (so `1,2,` is never mistaken for a prefix of `1,23,`);
- token-id prompts of completions are rendered like `input_ids`.

The body was already validated by `router.pipeline.resolve`; anything unexpected renders as ""
(the policy then treats the request as matching nothing), never as an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final


def routing_text(body: Mapping[str, Any]) -> str:
    """The whole prompt of `body` as one string (see the module docstring for the rule)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        system = body.get("system")  # Anthropic Messages: the system prompt stands apart
        head = "system\n" + content_text(system) + "\n" if system is not None else ""
        return head + _chat_text(messages)
    responses_input = body.get("input")  # the Responses API: a string, or a list of messages
    if isinstance(responses_input, str):
        return responses_input
    if isinstance(responses_input, list):
        return _chat_text(responses_input)
    for field in ("prompt", "text", "input_ids"):
        value = body.get(field)
        if value is not None:
            return _input_text(value)
    return ""


def _chat_text(messages: list[Any]) -> str:
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        parts.append(role if isinstance(role, str) else "")
        parts.append("\n")
        parts.append(content_text(message.get("content")))
        parts.append("\n")
    return "".join(parts)


def content_text(content: Any) -> str:
    """A message's text: its string content, or the text parts of a content list joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def _input_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        return ""
    if all(isinstance(item, str) for item in value):
        return "\n".join(value)
    if _is_ids(value):
        return _ids_text(value)
    if all(isinstance(item, list) and _is_ids(item) for item in value):
        return "\n".join(_ids_text(item) for item in value)
    return ""


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _ids_text(ids: list[int]) -> str:
    return "".join(f"{token}," for token in ids)


_PREFIX_CHARS: Final = 256
_PREFIX_TOKENS: Final = 64


def routing_key(session_id: bytes | None, body: Mapping[str, Any]) -> bytes | None:
    """What `consistent_hash` hashes for a request: its session, else its prompt's start.

    The `X-Session-ID` header wins when present. Otherwise the prefix of the prompt:
    for chat, the messages up to and including the first user message (a conversation
    grows by appending, so every turn of it keeps that key); for completions, `prompt`
    (a string, or the first of a batch); for `/generate`, `text` or `input_ids`. At most
    256 characters or 64 token ids count. None when there is nothing usable.
    """
    if session_id:
        return session_id
    prefix = _prompt_prefix(body)
    return prefix.encode("utf-8", "surrogatepass") if prefix else None


def _prompt_prefix(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat_prefix(messages)
    for field in ("prompt", "text", "input_ids"):
        value = body.get(field)
        if value is not None:
            return _input_prefix(value)
    return ""


def _chat_prefix(messages: list[Any]) -> str:
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        text = content_text(message.get("content"))
        parts.append(text)
        size += len(text) + 1
        if size > _PREFIX_CHARS or message.get("role") == "user":
            break
    return "\n".join(parts)[:_PREFIX_CHARS]


def _input_prefix(value: Any) -> str:
    """A prompt as a string, a token-id list, or a batch of either (its first member)."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value[:_PREFIX_CHARS]
    if isinstance(value, list) and value:
        return _token_prefix(value)
    return ""


def _token_prefix(ids: list[Any]) -> str:
    head = ids[:_PREFIX_TOKENS]
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in head):
        return ""
    return "ids:" + ",".join(map(str, head))

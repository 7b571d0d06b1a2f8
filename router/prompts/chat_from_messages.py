"""An Anthropic Messages body as the chat request vLLM makes of it
(`anthropic/serving.py` `to_chat_completion_request`), when it is text only: `system`
first, as one system message (a list's text blocks joined, a Claude Code billing-header
block dropped), then each user and assistant message, a single text block as a string
and several as text parts; a user message with no text left out, as vLLM leaves it.

Not rendered (`NotRendered`): `thinking` set to disabled and `output_config` (they
change the template's arguments by a probe of the template the router does not make),
tools, messages with the `system` role inside `messages` (vLLM merges them or not by
probing the template), and any block but text (images, tool use and results, thinking).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.prompts.chat_request import (
    CHAT_ADDS_SPECIAL_TOKENS,
    ChatRequest,
    NotRendered,
    merged_kwargs,
    user_kwargs,
)

_BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = frozenset({"user", "assistant"})
# Blocks vLLM accepts and drops without a trace in the prompt.
_SKIPPED_BLOCKS = frozenset({"redacted_thinking", "tool_reference"})


def read_messages_request(body: Mapping[str, Any]) -> ChatRequest:
    """A Messages body's chat request; NotRendered when the router does not render it."""
    thinking = body.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
    ):
        # Enabled or adaptive thinking sets a token budget, never a template argument.
        raise NotRendered("an Anthropic Messages request with thinking disabled")
    for field in ("output_config", "tools", "tool_choice"):
        if body.get(field) is not None:
            raise NotRendered(f"an Anthropic Messages request with {field}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise NotRendered("messages is not a list")
    chat: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        chat.append({"role": "system", "content": system})
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:  # a list or a dict is unhashable
            raise NotRendered("a message that is not a user or assistant message")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        texts = _texts(content)
        if not texts:
            if role == "user":
                continue
            raise NotRendered("an assistant message without text")
        if len(texts) == 1:
            chat.append({"role": role, "content": texts[0]})
        else:
            chat.append({"role": role, "content": [{"type": "text", "text": t} for t in texts]})
    extra = {"add_generation_prompt": True, "continue_final_message": False}
    return ChatRequest(
        chat,
        True,
        False,
        CHAT_ADDS_SPECIAL_TOKENS,
        None,
        merged_kwargs(user_kwargs(body.get("chat_template_kwargs")), extra),
    )


def _system_text(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    texts = [t for t in _texts(value) if not t.startswith(_BILLING_HEADER)]
    return "".join(texts)


def _texts(blocks: Any) -> list[str]:
    """The non-empty texts of a list of content blocks; NotRendered for any other block."""
    if not isinstance(blocks, list):
        raise NotRendered("content that is neither a string nor a list of blocks")
    texts: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in _SKIPPED_BLOCKS:
            continue
        if kind != "text":
            raise NotRendered(f"a {kind} block" if isinstance(kind, str) else "a block")
        text = block.get("text")
        if not isinstance(text, str):
            raise NotRendered("a text block without text")
        if text:
            texts.append(text)
    return texts

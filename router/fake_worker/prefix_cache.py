"""A fake worker's prefix cache: which prompt prefixes it would still hold in KV cache.

The tokenisation rule (deterministic, documented in docs/fake-worker.md):

- the prompt is rendered to text: chat as `<|role|>` + the message's text + newline per
  message (text parts of multimodal content joined); completions' `prompt` (a batch of
  strings joined by newlines); `/generate`'s `text`;
- one token per 4 bytes of that text in UTF-8 (the last token may be shorter);
- token-id prompts (`input_ids`, or a completions prompt of ids) are their own tokens;
- with `--tokenizer` (`router.fake_worker.model_tokens`), text and chat are the token
  ids a vLLM engine serving that model computes; what that does not cover keeps the
  rules above.

Tokens are cached in blocks of `BLOCK_TOKENS`, like an engine's KV pages: a block is
keyed by a hash chained over every block before it, so a block hits only when the whole
prefix up to it is the same. Only full blocks are cached, and at least the last prompt
token is always computed, as in the engines. Least recently used blocks go first once
the cache holds more than its capacity in tokens; a prompt's blocks are touched from its
end back to its start, so a shared prefix outlives the tails that hang off it.

What the cache stores, evicts and clears it tells its `listener` (`CacheListener`), in
the order it happens: the fake's KV-event publisher (`router.fake_worker.kv_publisher`)
turns that into vLLM's events. A block's token ids are its ids as given, or for text one
id per 4 bytes, the bytes read as a little-endian integer (`block_token_ids`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

BLOCK_TOKENS = 16
BYTES_PER_TOKEN = 4
_BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the cache sees it: its blocks' contents and its token count."""

    blocks: tuple[object, ...]
    tokens: int


def tokenize(path_api: str, body: Any) -> Prompt:
    """The prompt of a validated request body (`path_api`: "chat", "completions", "generate",
    "responses", "messages")."""
    if not isinstance(body, dict):
        return Prompt((), 0)
    if path_api in ("chat", "messages"):
        return _text_prompt(_chat_text(body.get("messages")))
    if path_api == "responses":
        value = body.get("input")
        return _text_prompt(value if isinstance(value, str) else _chat_text(value))
    value = body.get("prompt") if path_api == "completions" else body.get("text")
    if value is None and path_api == "generate":
        value = body.get("input_ids")
    if isinstance(value, str):
        return _text_prompt(value)
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return _text_prompt("\n".join(value))
    if isinstance(value, list) and all(isinstance(item, int) for item in value):
        return ids_prompt(value)
    return Prompt((), 0)


def ids_prompt(ids: Sequence[int]) -> Prompt:
    """A prompt of token ids: its full blocks, each a tuple of its ids."""
    blocks = tuple(
        tuple(ids[i : i + BLOCK_TOKENS])
        for i in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS)
    )
    return Prompt(blocks, len(ids))


def _chat_text(messages: Any) -> str:
    parts: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        parts.append(f"<|{message.get('role')}|>{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def _text_prompt(text: str) -> Prompt:
    data = text.encode("utf-8", "surrogatepass")
    full = len(data) - len(data) % _BLOCK_BYTES
    blocks = tuple(data[i : i + _BLOCK_BYTES] for i in range(0, full, _BLOCK_BYTES))
    return Prompt(blocks, -(-len(data) // BYTES_PER_TOKEN))


def block_token_ids(block: object) -> list[int]:
    """The token ids of one cached block (see the module docstring)."""
    if isinstance(block, bytes):
        return [
            int.from_bytes(block[i : i + BYTES_PER_TOKEN], "little")
            for i in range(0, len(block), BYTES_PER_TOKEN)
        ]
    assert isinstance(block, tuple)
    return list(block)


class CacheListener(Protocol):
    """Told of every change to a `PrefixCache`, synchronously, in order."""

    def stored(
        self,
        parent: int | None,
        keys: Sequence[int],
        blocks: Sequence[object],
        lora_name: str | None = None,
    ) -> None:
        """`keys` (a chain, each the child of the one before; the first the child of
        `parent`, None for the prompt's start) were stored, holding `blocks` computed with
        LoRA adapter `lora_name` (None: the base model)."""

    def removed(self, keys: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class PrefixCache:
    """An LRU of prompt blocks bounded to `capacity_tokens` (whole blocks)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = capacity_tokens // BLOCK_TOKENS
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.listener: CacheListener | None = None

    def __len__(self) -> int:
        """Tokens held now."""
        return len(self._blocks) * BLOCK_TOKENS

    def clear(self) -> None:
        self._blocks.clear()
        if self.listener is not None:
            self.listener.cleared()

    def serve(self, prompt: Prompt, lora_name: str | None = None) -> int:
        """Prefill `prompt` (with LoRA adapter `lora_name`: its blocks are its own, never the
        base model's nor another adapter's): how many of its tokens were cached; its
        blocks are cached after."""
        keys: list[int] = []
        parent = 0 if lora_name is None else hash(("lora", lora_name))
        for block in prompt.blocks:
            parent = hash((parent, block))
            keys.append(parent)
        blocks = self._blocks
        hits = 0
        for key in keys:
            if key not in blocks:
                break
            hits += 1
        listener = self.listener
        if listener is not None:
            self._report_stored(listener, keys, prompt.blocks, lora_name)
        for key in reversed(keys):
            blocks[key] = None
            blocks.move_to_end(key)
        evicted: list[int] = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        if listener is not None and evicted:
            listener.removed(evicted)
        return max(0, min(hits * BLOCK_TOKENS, prompt.tokens - 1))

    def _report_stored(
        self,
        listener: CacheListener,
        keys: list[int],
        prompt_blocks: tuple[object, ...],
        lora_name: str | None,
    ) -> None:
        # One report per run of blocks not held yet, each chained to the block before it.
        start: int | None = None
        for i, key in enumerate([*keys, None]):
            new = key is not None and key not in self._blocks
            if new and start is None:
                start = i
            elif not new and start is not None:
                listener.stored(
                    keys[start - 1] if start > 0 else None,
                    keys[start:i],
                    prompt_blocks[start:i],
                    lora_name,
                )
                start = None

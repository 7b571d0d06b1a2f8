"""The model's tokenizer, as the engines tokenize: completions text and rendered chat.

The `tokenizers` library is an optional dependency (the `kv` extra); chat rendering needs
`jinja2` too (`router.prompts.chat_template`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from router.prompts.chat_request import NotRendered
from router.prompts.chat_template import ChatTemplate
from router.prompts.detokenize import DecodeStep

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole character."""
COMPLETION_CONTEXT = 4
"""Sampled ids before a token that may complete its character: a UTF-8 character has at
most 4 bytes (vLLM's `max_context`)."""
INVALID_PREFIX = "Invalid prefix encountered"
"""How `tokenizers` says its incremental decoder cannot go on from where it is."""


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """The token ids an engine computes for a completions prompt `text`."""
        ...

    def chat_tokens(self, body: Mapping[str, Any], anthropic: bool = False) -> list[int]:
        """The token ids vLLM computes for a chat or Responses `body` (an Anthropic
        Messages body with `anthropic`); NotRendered when the router does not render it as
        the engine does, TemplateFailed when the template raises for it or runs past its
        bounds."""
        ...

    def decode_stream(
        self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> DecodeStep:
        """A decoder of one sequence's generated ids, primed with its prompt's ids, that
        gives each id's text as vLLM's streaming detokenizer does."""
        ...

    def token_text(self, token_id: int, context: Sequence[int] = ()) -> str:
        """One id's text, as vLLM writes a logprob's `token`: the id on its own, or, when
        that is part of a character, completed from `context` (the ids sampled before it,
        oldest first)."""
        ...


class HfTokenizer:
    """The model's tokenizer through the `tokenizers` library (an optional dependency):
    `path` is a `tokenizer.json`, or the model's directory holding one and, for chat,
    the chat template and special tokens (`tokenizer_config.json`, `chat_template.jinja`;
    rendering needs the `jinja2` package). Completions text is encoded with special tokens
    added: what vLLM's completions and SGLang's `/generate` compute."""

    def __init__(self, path: str) -> None:
        try:
            module = importlib.import_module("tokenizers")
        except ModuleNotFoundError:
            raise ValueError("needs the `tokenizers` package (pip install tokenizers)") from None
        directory = Path(path)
        file = directory / "tokenizer.json" if directory.is_dir() else directory
        try:
            self._tokenizer = module.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception types
            raise ValueError(f"cannot load {file}: {exc}") from None
        self._decode_stream = module.decoders.DecodeStream
        self._space_marker = _leading_space_marker(self._tokenizer.to_str())
        self.chat: ChatTemplate | None = None
        """The model's chat template; None for a tokenizer.json alone, or a directory
        without a template the router renders (chat then gets no prediction)."""
        if directory.is_dir():
            self.chat = ChatTemplate.from_model_dir(directory)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def chat_tokens(self, body: Mapping[str, Any], anthropic: bool = False) -> list[int]:
        if self.chat is None:
            raise NotRendered("no chat template")
        prompt = self.chat.render(body, anthropic=anthropic)
        return self.encode(prompt.text, prompt.add_special_tokens)

    def token_text(self, token_id: int, context: Sequence[int] = ()) -> str:
        # vLLM's `convert_ids_list_to_tokens`: the id decoded alone (special tokens kept),
        # with the leading spaces a Metaspace decoder strips put back from the raw piece;
        # then, as its logprobs processor corrects a text ending in U+FFFD, completed from
        # the sampled ids before it.
        text = self._decode([token_id])
        if text.endswith(REPLACEMENT):
            return self._completed(token_id, context[-COMPLETION_CONTEXT:])
        marker = self._space_marker
        if marker is None:
            return text
        raw = self._tokenizer.id_to_token(token_id) or ""
        markers = len(raw) - len(raw.lstrip(marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False) or ""

    def _completed(self, token_id: int, context: Sequence[int]) -> str:
        """The text `token_id` completes with the fewest of the ids before it (vLLM's
        `_correct_decoded_token`): the characters it finishes, counting the bytes of the
        partial ids just before it (whose own texts were ""); "" when it finishes none."""
        for size in range(1, len(context) + 1):
            window = list(context[-size:])
            whole = self._decode([*window, token_id])
            if whole.endswith(REPLACEMENT):
                continue
            clean = len(window)
            while clean > 0 and self._decode([window[clean - 1]]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self._decode(window[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix) :]
            # A normalizer can make the two differ: what follows their common start.
            common = next(
                (i for i, (a, b) in enumerate(zip(prefix, whole, strict=False)) if a != b),
                min(len(prefix), len(whole)),
            )
            return whole[common:]
        return ""

    def decode_stream(
        self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> DecodeStep:
        # `tokenizers`' own incremental decoder, primed with the prompt as vLLM primes it,
        # and recovered as vLLM recovers it: an id out of range gives no text, and a decoder
        # left in an invalid state (non-monotonic UTF-8 output) starts again unprimed.
        new_stream = self._decode_stream
        streams = [new_stream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)]
        tokenizer = self._tokenizer

        def step(token_id: int) -> str | None:
            try:
                piece: str | None = streams[0].step(tokenizer, token_id)
            except (OverflowError, TypeError):
                return None
            except Exception as exc:  # the library raises its own Exception types
                if not str(exc).startswith(INVALID_PREFIX):
                    raise
                streams[0] = new_stream(skip_special_tokens=skip_special_tokens)
                piece = streams[0].step(tokenizer, token_id)
            return piece

        return step


def _leading_space_marker(tokenizer_json: str) -> str | None:
    """The character a Metaspace pre-tokenizer stands for a space with (SentencePiece
    models), whose leading instance decoding an id alone strips; None for other
    pre-tokenizers (byte-level ones keep their spaces)."""
    try:
        pre = json.loads(tokenizer_json).get("pre_tokenizer") or {}
    except ValueError:
        return None
    candidates = pre.get("pretokenizers") or () if pre.get("type") == "Sequence" else (pre,)
    for candidate in candidates:
        if isinstance(candidate, dict) and candidate.get("type") == "Metaspace":
            marker = candidate.get("replacement", "\u2581")
            return marker if isinstance(marker, str) and marker else None
    return None

"""A model directory as the engines read it, written from code: a word-level tokenizer
(BOS added, as many models' tokenizer.json do), special tokens and a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from conformance.tiny_model import BOS, CHAT_TEMPLATE, EOS

WORDS = "you are a router tell me about the cache hello world first last part and it is".split()
MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|developer|>"]
# The same template conformance/tiny_model.py gives the engine tests' model.
TEMPLATE = CHAT_TEMPLATE


def build_tokenizer() -> tokenizers.Tokenizer:
    """A word-level tokenizer that adds a BOS token, as many models' tokenizer.json do."""
    specials = [BOS, EOS, *MARKERS]
    vocab = {"[UNK]": 0, **{token: n + 1 for n, token in enumerate(specials)}}
    vocab.update({word: len(vocab) + n for n, word in enumerate(WORDS)})
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.add_special_tokens(specials)
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return model


def write_model(
    directory: Path,
    template: str | list[dict[str, str]] | None = TEMPLATE,
    *,
    jinja: str | None = None,
    **config: Any,
) -> Path:
    """A model directory as the engines read it: tokenizer.json, tokenizer_config.json
    (special tokens, the template) and, when given, chat_template.jinja."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    settings: dict[str, Any] = {"bos_token": BOS, "eos_token": EOS, **config}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory

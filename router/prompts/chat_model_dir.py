"""What a model directory holds for chat: its chat templates and the tokenizer's named
special tokens, read as transformers loads them, and whether vLLM renders the model's
chats with them at all (vLLM's `renderers/hf.py` `resolve_chat_template`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def not_renderable(directory: Path) -> str | None:
    """Why vLLM would not render this model's chat with its template (another renderer,
    another template source); None when it would."""
    if not (directory / "tokenizer_config.json").is_file():
        return "has no tokenizer_config.json"
    config = read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
    if config.get("model_type") == "gpt_oss":
        return "is a gpt-oss model (vLLM renders its chats as Harmony messages)"
    if any(directory.glob("consolidated*.safetensors")) and (
        (directory / "tekken.json").is_file() or any(directory.glob("tokenizer.model.v*"))
    ):
        return "is a Mistral model (vLLM renders it with mistral_common)"
    for name in ("chat_template.json", "processor_config.json", "preprocessor_config.json"):
        if (directory / name).is_file():
            return f"has {name} (a processor's template comes first in vLLM; not read here)"
    return None


def find_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The templates by name, as transformers loads them: template files first, then the
    config's `chat_template`."""
    found: dict[str, str] = {}
    single = directory / "chat_template.jinja"
    if single.is_file():
        found["default"] = _read_text(single)
    named = directory / "chat_templates"
    if named.is_dir():
        for path in sorted(named.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = _read_text(path)
    if found:
        return found
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                if isinstance(entry.get("template"), str):
                    found[entry["name"]] = entry["template"]
    return found


def find_special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The tokenizer's named special tokens (transformers' `special_tokens_map`): each
    `*_token` of tokenizer_config.json that holds a token, and the named
    `extra_special_tokens`; special_tokens_map.json over them when the config lists no
    `added_tokens_decoder` (transformers' legacy path)."""
    values: dict[str, Any] = dict(config)
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        values.update(read_json(legacy))
    tokens: dict[str, str] = {}
    for key, value in values.items():
        if key.endswith("_token") and (token := _token_text(value)) is not None:
            tokens[key] = token
    extra = values.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if (token := _token_text(value)) is not None:
                tokens[str(key)] = token
    return tokens


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])  # a serialized AddedToken
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as error:  # ValueError: not UTF-8
        raise ValueError(f"cannot read {path}: {error}") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ValueError when it cannot be read or holds something else."""
    text = _read_text(path)
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"cannot read {path}: not a JSON object")
    return value

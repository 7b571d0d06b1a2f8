"""`router fake-worker --tokenizer MODEL_DIR`: the prefix cache sees the token ids a vLLM
engine serving that model computes, so the cache's blocks and its KV events carry real
token ids and a router started with the same `--kv-tokenizer` predicts them: fleet-scale
`kv_aware` tests and benchmarks without an engine.

The ids come from the router's own reading of the model (`HfTokenizer`: its tokenizer,
and its chat template rendered as vLLM 0.32 renders it), the part `tests/engine/
test_chat_tokens.py` holds to a real engine. A body that reading does not render (media,
tools in Messages, a template that raises) keeps the fake's byte rule
(`router.fake_worker.prefix_cache`), as does a prompt of token ids, which is its own.
"""

from __future__ import annotations

from typing import Any

from router.fake_worker.prefix_cache import Prompt, ids_prompt
from router.prompts.chat_request import NotRendered
from router.prompts.chat_template import TemplateFailed
from router.prompts.tokenizer import HfTokenizer

CHAT_APIS = ("chat", "messages", "responses")


class ModelTokens:
    """The model's tokens for request bodies; `path` as `--kv-tokenizer` takes it."""

    def __init__(self, path: str) -> None:
        self.tokenizer = HfTokenizer(path)  # ValueError naming the file it cannot load

    def prompt(self, path_api: str, body: Any) -> Prompt | None:
        """The prompt of a validated body in the model's tokens; None where the byte rule
        applies."""
        if not isinstance(body, dict):
            return None
        try:
            if path_api in CHAT_APIS:
                ids = self.tokenizer.chat_tokens(body, anthropic=path_api == "messages")
            else:
                text = body.get("prompt") if path_api == "completions" else body.get("text")
                if not isinstance(text, str):
                    return None
                ids = self.tokenizer.encode(text)
        except (NotRendered, TemplateFailed):
            return None
        return ids_prompt(ids)

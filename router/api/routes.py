"""The inference API as one table: which model-keyed routes the router forwards, and how.

A route's kind decides how it is served. Generation routes may run on a prefill/decode
pair (the handoff fields injected into the body), may stream, and have their body fields
checked before any worker is chosen. Other routes (embeddings, rerank, tokenize, ...) go
to a mixed worker of the model: prefill and decode engines serve generation only. Every
route fails over, feeds the breaker and counts in the metrics the same way; its errors
come in its own API's dialect. Adding a route is one line in `ROUTES`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Kind(enum.StrEnum):
    GENERATION = "generation"
    """May run prefill/decode, may stream, body fields checked by the router."""
    NON_GENERATION = "non_generation"
    """A mixed worker of the model answers it; never PD, never streamed."""


class Dialect(enum.StrEnum):
    """The error shape of a route's API (see `router.api.error_shapes`)."""

    OPENAI = "openai"
    """`{"error": {...}}`; a broken stream ends with `event: error`."""
    RESPONSES = "responses"
    """OpenAI-shaped errors; a broken stream ends with `response.failed`."""
    ANTHROPIC = "anthropic"
    """`{"type": "error", "error": {...}}`; a broken stream ends with `event: error`."""


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    label: str
    """The `route` label of the metrics, and the name the body checks go by."""
    kind: Kind
    dialect: Dialect
    reads: tuple[str, ...]
    """The body fields the router reads (documented in docs/api.md); the rest is forwarded
    untouched."""

    @property
    def generation(self) -> bool:
        return self.kind is Kind.GENERATION

    @property
    def streams(self) -> bool:
        """Whether `"stream": true` in the body asks for SSE."""
        return self.kind is Kind.GENERATION


_GEN: Final = Kind.GENERATION
_OTHER: Final = Kind.NON_GENERATION
_OPENAI: Final = Dialect.OPENAI
_RESPONSES: Final = Dialect.RESPONSES
_ANTHROPIC: Final = Dialect.ANTHROPIC
_MODEL: Final = ("model",)
_SAMPLING: Final = ("n", "max_tokens", "max_completion_tokens", "temperature", "top_p")

ROUTES: Final[dict[str, Route]] = {
    route.path: route
    for route in (
        Route(
            "/v1/chat/completions",
            "chat",
            _GEN,
            _OPENAI,
            ("model", "stream", "messages", *_SAMPLING),
        ),
        Route(
            "/v1/completions",
            "completions",
            _GEN,
            _OPENAI,
            ("model", "stream", "prompt", *_SAMPLING),
        ),
        Route(
            "/generate",
            "generate",
            _GEN,
            _OPENAI,
            ("model", "stream", "text", "input_ids", "sampling_params"),
        ),
        Route("/v1/responses", "responses", _GEN, _RESPONSES, ("model", "stream", *_SAMPLING)),
        Route(
            "/v1/messages",
            "messages",
            _GEN,
            _ANTHROPIC,
            ("model", "stream", "messages", *_SAMPLING),
        ),
        Route("/v1/embeddings", "embeddings", _OTHER, _OPENAI, _MODEL),
        Route("/v1/rerank", "rerank", _OTHER, _OPENAI, _MODEL),
        Route("/v1/score", "score", _OTHER, _OPENAI, _MODEL),
        Route("/v1/classify", "classify", _OTHER, _OPENAI, _MODEL),
        Route("/v1/tokenize", "tokenize", _OTHER, _OPENAI, _MODEL),
        Route("/v1/detokenize", "detokenize", _OTHER, _OPENAI, _MODEL),
        Route("/tokenize", "tokenize", _OTHER, _OPENAI, _MODEL),
        Route("/detokenize", "detokenize", _OTHER, _OPENAI, _MODEL),
        Route("/pooling", "pooling", _OTHER, _OPENAI, _MODEL),
    )
}

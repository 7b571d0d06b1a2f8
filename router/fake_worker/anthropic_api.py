"""Anthropic's Messages API (`/v1/messages`) as a fake engine speaks it: parse a request,
render the message and its SSE event sequence, and errors in Anthropic's shape.

A stream is `message_start`, `content_block_start`, `ping`, one `content_block_delta` per
token, `content_block_stop`, `message_delta` (stop reason and output tokens) and
`message_stop`. Usage counts are honest: input tokens are the words of `system` and of
every message, output tokens the tokens generated.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.fake_worker.behaviour import MAX_TOKENS
from router.fake_worker.formats import (
    Api,
    BadGenerationRequest,
    Generation,
    content_words,
    expected_text,
    token_bytes,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_body(message: str, status: int) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}`, the type Anthropic gives `status`."""
    kind = _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def parse_message_request(body: Any, default_model: str) -> Generation:
    """Anthropic requires `max_tokens`, and so does this fake: without it, a 400."""
    if not isinstance(body, dict):
        raise BadGenerationRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        model = default_model
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadGenerationRequest("stream: must be true or false")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_TOKENS:
        raise BadGenerationRequest(f"max_tokens: required, an integer between 1 and {MAX_TOKENS}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadGenerationRequest("messages: must be a non-empty list")
    prompt = content_words(body.get("system"))
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadGenerationRequest(
                "messages: each must be an object with role 'user' or 'assistant'"
            )
        prompt += content_words(message.get("content"))
    return Generation(
        api=Api.MESSAGES,
        model=model,
        stream=stream,
        tokens=limit,
        explicit_limit=True,
        n=1,
        prompt_tokens=prompt,
        include_usage=True,
    )


def _message(gen: Generation, message_id: str, *, done: bool) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": gen.model,
        "content": [{"type": "text", "text": expected_text(gen.tokens)}] if done else [],
        # The fake always generates up to the limit: that is why it stopped.
        "stop_reason": "max_tokens" if done else None,
        "stop_sequence": None,
        "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": gen.tokens if done else 0},
    }


def message_body(gen: Generation, message_id: str) -> bytes:
    return orjson.dumps(_message(gen, message_id, done=True))


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"
    )


_DELTA_PREFIX = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"'
)


class MessageFrames:
    """The SSE events of one streaming message, in the shape `paced_events` walks."""

    def __init__(self, gen: Generation, message_id: str) -> None:
        self.gen = gen
        self.message_id = message_id

    def head(self) -> list[bytes]:
        return [
            _event("message_start", {"message": _message(self.gen, self.message_id, done=False)}),
            _event(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            ),
            _event("ping", {}),
        ]

    def token(self, i: int, choice: int = 0) -> bytes:
        return _DELTA_PREFIX + token_bytes(i) + b'"}}\n\n'

    def tail(self) -> list[bytes]:
        return [
            _event("content_block_stop", {"index": 0}),
            _event(
                "message_delta",
                {
                    "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                    "usage": {"output_tokens": self.gen.tokens},
                },
            ),
            _event("message_stop", {}),
        ]

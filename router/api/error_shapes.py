"""The router's own errors in each API's dialect: whole answers and the last event of a
broken stream.

A `RouterError` says what went wrong (status, type, code, message); this module only says
how each API writes it down, so a client library of that API reads it as an error:

- OpenAI (chat, completions, `/generate`, embeddings, ...): `{"error": {"message", "type",
  "code"}}`; a broken stream ends with `event: error` carrying the same object.
- OpenAI Responses: the same answers; a broken stream ends with `response.failed`, whose
  response has `status: "failed"` and `error: {code, message}`.
- Anthropic Messages: `{"type": "error", "error": {"type", "message"}}` with Anthropic's
  error type for the status; a broken stream ends with `event: error` and that object.
  The router's `code` (`model_not_found`, `no_available_workers`, ...) rides along in
  `error.code`, so 404 versus 503 keeps its meaning for a reader that looks.

Workers' own answers are never re-shaped: a 4xx or a last 5xx goes back verbatim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import orjson

from router.api.errors import RouterError
from router.api.routes import Dialect

# Anthropic's error type for an HTTP status (its API documents these names).
_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error type for `status`: a 4xx it has no name for is an invalid request,
    anything else an `api_error`."""
    found = _ANTHROPIC_TYPES.get(status)
    if found is not None:
        return found
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(error: RouterError, dialect: Dialect) -> bytes:
    """The body of the answer `error` becomes on a route of `dialect`."""
    if dialect is Dialect.ANTHROPIC:
        return orjson.dumps(
            {
                "type": "error",
                "error": {
                    "type": anthropic_type(error.status),
                    "message": error.message,
                    "code": error.code,
                },
            }
        )
    return error.body()


def stream_error_event(message: str, code: str, dialect: Dialect) -> bytes:
    """The event that ends a stream the worker broke after the client got its 200.

    `code` is the router's (`stream_interrupted`, `stream_idle_timeout`). Nothing of the
    broken stream is parsed to build it (no per-chunk JSON on the hot path), so the
    Responses failure event names no response id and no sequence number.
    """
    if dialect is Dialect.ANTHROPIC:
        payload = {
            "type": "error",
            "error": {"type": "api_error", "message": message, "code": code},
        }
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
    if dialect is Dialect.RESPONSES:
        payload = {
            "type": "response.failed",
            "response": {
                "object": "response",
                "status": "failed",
                "error": {"code": "server_error", "message": message},
                "output": [],
                "metadata": {"router_code": code},
            },
        }
        return b"event: response.failed\ndata: " + orjson.dumps(payload) + b"\n\n"
    payload = {"error": {"message": message, "type": "upstream_error", "code": code}}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


def _stream_error_builder(dialect: Dialect) -> Callable[[str, str], bytes]:
    def build(message: str, code: str) -> bytes:
        return stream_error_event(message, code, dialect)

    return build


STREAM_ERROR_EVENTS: Final[dict[Dialect, Callable[[str, str], bytes]]] = {
    dialect: _stream_error_builder(dialect) for dialect in Dialect
}
"""`(message, code) -> event` per dialect, built once: what `relay_stream` takes."""

"""The router's errors in each API's own shape, and a broken stream's last event."""

from __future__ import annotations

import orjson
import pytest

from router.api.error_shapes import (
    STREAM_ERROR_EVENTS,
    anthropic_type,
    error_body,
    stream_error_event,
)
from router.api.errors import (
    BadRequest,
    MethodNotAllowed,
    ModelNotFound,
    NoAvailableWorkers,
    PayloadTooLarge,
    WorkerUnreachable,
)
from router.api.routes import Dialect


def test_openai_and_responses_routes_keep_the_openai_body() -> None:
    error = ModelNotFound("model 'x' is not served by any worker")
    for dialect in (Dialect.OPENAI, Dialect.RESPONSES):
        assert error_body(error, dialect) == error.body()
    assert orjson.loads(error.body())["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (BadRequest("bad"), "invalid_request_error"),
        (ModelNotFound("gone"), "not_found_error"),
        (MethodNotAllowed("no", b"POST"), "invalid_request_error"),
        (PayloadTooLarge("big"), "request_too_large"),
        (NoAvailableWorkers("busy"), "overloaded_error"),
        (WorkerUnreachable("down"), "api_error"),
    ],
)
def test_anthropic_body_has_its_type_and_keeps_the_routers_code(
    error: Exception, kind: str
) -> None:
    assert isinstance(
        error,
        BadRequest
        | ModelNotFound
        | MethodNotAllowed
        | PayloadTooLarge
        | NoAvailableWorkers
        | WorkerUnreachable,
    )
    body = orjson.loads(error_body(error, Dialect.ANTHROPIC))
    assert body == {
        "type": "error",
        "error": {"type": kind, "message": error.message, "code": error.code},
    }


def test_anthropic_type_for_statuses_it_has_no_name_for() -> None:
    assert anthropic_type(418) == "invalid_request_error"
    assert anthropic_type(599) == "api_error"
    assert anthropic_type(429) == "rate_limit_error"


def event(raw: bytes) -> tuple[str, dict[str, object]]:
    assert raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
    name_line, data_line = raw.rstrip(b"\n").split(b"\n")
    assert name_line.startswith(b"event: ") and data_line.startswith(b"data: ")
    return name_line[7:].decode(), orjson.loads(data_line[6:])


def test_each_dialect_ends_a_broken_stream_its_own_way() -> None:
    assert event(stream_error_event("m", "stream_interrupted", Dialect.OPENAI)) == (
        "error",
        {"error": {"message": "m", "type": "upstream_error", "code": "stream_interrupted"}},
    )
    assert event(stream_error_event("m", "stream_idle_timeout", Dialect.ANTHROPIC)) == (
        "error",
        {
            "type": "error",
            "error": {"type": "api_error", "message": "m", "code": "stream_idle_timeout"},
        },
    )
    name, data = event(stream_error_event("m", "stream_interrupted", Dialect.RESPONSES))
    assert name == "response.failed"
    assert data["type"] == "response.failed"
    assert data["response"] == {
        "object": "response",
        "status": "failed",
        "error": {"code": "server_error", "message": "m"},
        "output": [],
        "metadata": {"router_code": "stream_interrupted"},
    }
    for dialect in Dialect:
        assert STREAM_ERROR_EVENTS[dialect]("m", "c") == stream_error_event("m", "c", dialect)

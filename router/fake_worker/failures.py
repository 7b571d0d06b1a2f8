"""The scripted failures, as a client sees them: an error status, a TCP reset, silence,
a body that is not JSON, or a 200 that breaks mid-way."""

from __future__ import annotations

from collections.abc import Iterable

import orjson
import trio

from router.fake_worker.anthropic_api import anthropic_error_body
from router.fake_worker.behaviour import Behaviour, FailMode
from router.fake_worker.formats import DONE
from router.http.server.messages import Headers, Request, ResponseWriter

JSON_HEADERS: Headers = ((b"content-type", b"application/json"),)
SSE_HEADERS: Headers = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))
GARBAGE_BODY = b"<html>fake worker: this body is deliberately not JSON"


def error_body(message: str, type_: str, code: str | int) -> bytes:
    """An OpenAI-shaped error: {"error": {"message", "type", "code"}}."""
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code}})


def vllm_error_body(message: str, type_: str, status: int, param: str | None) -> bytes:
    """vLLM's error: {"error": {"message", "type", "param", "code"}}, `code` the status.

    `type` is "Bad Request" for a body its request schema rejects (`param`: `body.<field>`),
    "BadRequestError" for a value it refuses (`param`: the field), "NotFoundError" for an
    unknown model (`param`: "model").
    """
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": status}}
    )


def error_body_for(path: str, message: str, type_: str, status: int) -> bytes:
    """An error in the shape of the API at `path`: Anthropic's on `/v1/messages`, else OpenAI's."""
    if path == "/v1/messages":
        return anthropic_error_body(message, status)
    return error_body(message, type_, status)


async def serve_failure(
    behaviour: Behaviour, request: Request, writer: ResponseWriter, streaming: bool
) -> None:
    """Answer with the scripted failure of every mode but `midstream` (which needs the
    generation's own events: `break_stream`, `break_unary`).

    Cancellation (`hang` waits for it): nothing was sent, nothing is left behind.
    """
    mode = behaviour.fail_mode
    if mode is FailMode.STATUS:
        status = behaviour.fail_status
        headers: Headers = JSON_HEADERS
        if status in (429, 503):
            headers = (*JSON_HEADERS, (b"retry-after", b"1"))
        if status == 429:
            kind = "rate_limit_exceeded"
        elif status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        message = f"scripted failure: fake worker answers {status}"
        await writer.respond(status, headers, error_body_for(request.path, message, kind, status))
    elif mode is FailMode.RESET:
        await drop_connection(request, writer, reset=True)
    elif mode is FailMode.HANG:
        await trio.sleep_forever()
    elif mode is FailMode.GARBAGE:
        if streaming:
            await writer.start(200, SSE_HEADERS)
            await writer.write(b"data: {" + GARBAGE_BODY + b"\n\n" + DONE)
            await writer.finish()
        else:
            await writer.respond(200, JSON_HEADERS, GARBAGE_BODY)
    else:
        raise ValueError(f"{mode} needs break_stream or break_unary")


async def break_stream(
    request: Request, writer: ResponseWriter, events: Iterable[bytes | float], chunks: int
) -> None:
    """A 200 stream of at most `chunks` data events (never `[DONE]`), paced like a real
    one (a float in `events` is a pause), then the connection closes mid-body."""
    await writer.start(200, SSE_HEADERS)
    remaining = chunks
    for item in events:
        if remaining == 0 or item is DONE:
            break
        if isinstance(item, float):
            await trio.sleep(item)
        else:
            await writer.write(item)
            remaining -= 1
    await drop_connection(request, writer, reset=False)


async def break_unary(request: Request, writer: ResponseWriter, body: bytes) -> None:
    """A 200 with the first half of `body`, then the connection closes mid-body."""
    await writer.start(200, JSON_HEADERS)
    await writer.write(body[: len(body) // 2])
    await drop_connection(request, writer, reset=False)


async def drop_connection(request: Request, writer: ResponseWriter, *, reset: bool) -> None:
    """Leave the client with a broken connection: a TCP reset, or a close mid-answer."""
    await writer.abort(reset=reset)

"""Request identity: one id per request, sent to every worker leg, echoed, and logged.

The id is the first usable of the client's `x-request-id`, `x-correlation-id` and the
trace id of a W3C `traceparent`; otherwise a new random one. A client's value is used
only when it is short printable ASCII: it ends up in log lines and in headers to workers,
so a value that could forge a log line or blow up a header is replaced, not trusted.

The id of the request being served lives in a context variable: trio gives every task a
copy of its parent's context, so each log line written on the request's behalf (attempt
failures, breaker trips) can name it without passing it through every call.
"""

from __future__ import annotations

import contextvars
import os
import random
import re
from typing import Final

from router.http.server.messages import Headers, Request, ResponseWriter

REQUEST_ID: Final = b"x-request-id"
CORRELATION_ID: Final = b"x-correlation-id"
TRACEPARENT: Final = b"traceparent"
MAX_ID_BYTES: Final = 128
_USABLE: Final = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_ID_BYTES)
_TRACEPARENT: Final = re.compile(rb"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE: Final = b"0" * 32

# Ids need to be unique, not secret: a generator seeded from the OS once per process (and
# again in a forked child, which would otherwise repeat its parent's ids) instead of a
# `getrandom` system call per request.
_ids: Final = random.Random()
os.register_at_fork(after_in_child=_ids.seed)

_current: Final[contextvars.ContextVar[str]] = contextvars.ContextVar(
    "router_request_id", default="-"
)


def current_request_id() -> str:
    """The id of the request this task serves, or `-` outside of any request."""
    return _current.get()


def choose_request_id(request: Request) -> bytes:
    """The request's id: the client's, when usable, else a fresh random one."""
    given_id = correlation = parent = None
    for name, value in request.headers:
        if name == REQUEST_ID and given_id is None:
            given_id = value
        elif name == CORRELATION_ID and correlation is None:
            correlation = value
        elif name == TRACEPARENT and parent is None:
            parent = value
    for candidate in (given_id, correlation):
        if candidate is not None and _USABLE.fullmatch(candidate):
            return candidate
    if parent is not None:
        match = _TRACEPARENT.fullmatch(parent.strip())
        if match and match.group(1) != _ZERO_TRACE:
            return match.group(1)
    return b"%032x" % _ids.getrandbits(128)


def identify(request: Request) -> tuple[bytes, contextvars.Token[str]]:
    """Give `request` its id: set as its `x-request-id` header (the one workers get) and as
    the current task's id for logs. Reset the returned token when the request is done."""
    request_id = choose_request_id(request)
    headers = [(name, value) for name, value in request.headers if name != REQUEST_ID]
    headers.append((REQUEST_ID, request_id))
    request.headers = headers
    return request_id, _current.set(request_id.decode("ascii"))


def forget(token: contextvars.Token[str]) -> None:
    _current.reset(token)


class IdentifiedWriter:
    """A response writer that puts the request's id on the answer, in place of a worker's.

    Everything but the response head passes through unchanged: `write`, `finish` and
    `abort` are the writer's own methods (no coroutine of this one's per relayed event).
    """

    __slots__ = ("_header", "_writer", "abort", "finish", "write")

    def __init__(self, writer: ResponseWriter, request_id: bytes) -> None:
        self._writer = writer
        self._header = (REQUEST_ID, request_id)
        self.write = writer.write
        self.finish = writer.finish
        self.abort = writer.abort

    @property
    def started(self) -> bool:
        return self._writer.started

    def _with_id(self, headers: Headers) -> list[tuple[bytes, bytes]]:
        return [*(item for item in headers if item[0] != REQUEST_ID), self._header]

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        await self._writer.respond(status, self._with_id(headers), body)

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        await self._writer.start(status, self._with_id(headers), first)

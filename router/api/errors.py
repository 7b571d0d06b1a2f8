"""The router's error tree: every answer the client is told about when a request fails.

Each error maps to exactly one HTTP answer, here and nowhere else: its status, its
`{"error": {message, type, code}}` body (`router.api.error_shapes` renders the other
dialects from the same fields) and its headers. The HTTP server's own refusals are mapped
onto this tree at the boundary (`answer_refusal`), so the server never speaks for the API.

    RouterError
    ├── BadRequest 400, InvalidApiKey 401, NotFound 404, MethodNotAllowed 405,
    │   RequestTimeout 408, Conflict 409, PayloadTooLarge 413, HeadersTooLarge 431
    │   └── BadRequest: InvalidPriority, PriorityNotAllowed, InvalidTenant (400 each)
    ├── ModelNotFound 404
    ├── WorkerUnreachable 502
    └── RetryLater (Retry-After)
        ├── NoAvailableWorkers 503, ServerBusy 503, RouterOverloaded 503
        └── AdmissionRefused
            ├── QueueFull 429
            └── QueueTimeout 503
"""

from __future__ import annotations

import math
from typing import ClassVar, Final

import orjson

from router.http.server.exceptions import (
    AtCapacity,
    BodyTooLarge,
    ClientTooSlow,
    HandlerFailed,
    HeadTooLarge,
    MalformedRequest,
    Refusal,
    RefusalAnswer,
)

JSON_CONTENT_TYPE: Final = (b"content-type", b"application/json")


def retry_after(seconds: float) -> tuple[bytes, bytes]:
    """The `Retry-After` header for a wait of `seconds`: whole seconds, at least one."""
    return (b"retry-after", b"%d" % max(1, math.ceil(seconds)))


class RouterError(Exception):
    """An error the client is told about, OpenAI-shaped: {"error": {message, type, code}}."""

    # Class variables, so that each subclass's own values are read: compiled (setup.py),
    # plain ones would be per-instance attributes a subclass's class body does not set.
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "code": self.code}}
        )


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotOverGrpc(BadRequest):
    """400: the request needs what the gRPC path does not do (tool calls, structured
    output, logprobs, multimodal input, a route other than the generation routes),
    and no HTTP worker of its model could take it instead. The message names the gap."""

    code = "unsupported_over_grpc"


class InvalidPriority(BadRequest):
    """400: the priority header names no priority class of this router."""

    code = "invalid_priority"


class PriorityNotAllowed(BadRequest):
    """400: the priority header claims a class above what the client's key may claim."""

    code = "priority_not_allowed"


class InvalidTenant(BadRequest):
    """400: the tenant header the client's key names holds no usable tenant name."""

    code = "invalid_tenant"


class InvalidApiKey(RouterError):
    """401: the request carries no client key, a malformed one, or one nobody issued."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", b'Bearer realm="router"')]


class NotFound(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(RouterError):
    """405, naming the methods the route takes (RFC 9110 requires `Allow`)."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, allow: bytes) -> None:
        super().__init__(message)
        self.allow = allow

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"allow", self.allow)]


class RequestTimeout(RouterError):
    """The client took too long to send its request head or body (slowloris)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Conflict(RouterError):
    """409: the admin API cannot change a fleet that discovery owns."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class HeadersTooLarge(RouterError):
    """The request line and headers are over the server's limit."""

    status = 431
    type = "invalid_request_error"
    code = "request_headers_too_large"


class ModelNotFound(RouterError):
    """No worker of any role or status is registered for the model."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class WorkerUnreachable(RouterError):
    """Every attempt failed before any worker answered."""

    status = 502
    type = "bad_gateway"
    code = "worker_unreachable"


class RetryLater(RouterError):
    """An answer that tells the client when to come back (`Retry-After`)."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [retry_after(self.retry_after_s)]


class NoAvailableWorkers(RetryLater):
    """Workers for the model exist, but a leg the request needs has none that can take it."""

    code = "no_available_workers"


class ServerBusy(RetryLater):
    """The server is at its connection cap or its body budget."""

    code = "server_busy"


class RouterOverloaded(RetryLater):
    """The router itself ran short (file descriptors, local ports, a worker's connection
    cap): no worker is at fault, and the client may retry shortly. `kind` names the
    shortage, as `router_local_errors_total{kind}` counts it."""

    code = "router_overloaded"

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class AdmissionRefused(RetryLater):
    """The router's admission gate (`--max-concurrent-requests`) turned the request away."""


class QueueFull(AdmissionRefused):
    """429: the admission queue is full, or the request's tenant's share of it
    (`limit` says which: `queue` or `tenant_queue`)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, retry_after_s: float = 1.0, limit: str = "queue") -> None:
        super().__init__(message, retry_after_s)
        self.limit = limit


class QueueTimeout(AdmissionRefused):
    """503: the request waited in the admission queue for as long as it may (`limit` names
    what held it: `concurrency`, the router's limit, or `tenant_inflight`, its tenant's
    own cap)."""

    code = "queue_timeout"

    def __init__(
        self, message: str, retry_after_s: float = 1.0, limit: str = "concurrency"
    ) -> None:
        super().__init__(message, retry_after_s)
        self.limit = limit


# The HTTP server's refusals, as the errors a client of the router is told.
_REFUSALS: Final[dict[type[Refusal], type[RouterError]]] = {
    MalformedRequest: BadRequest,
    ClientTooSlow: RequestTimeout,
    BodyTooLarge: PayloadTooLarge,
    HeadTooLarge: HeadersTooLarge,
    AtCapacity: ServerBusy,
    HandlerFailed: RouterError,
}


def as_router_error(refusal: Refusal) -> RouterError:
    """The error of this tree that a refusal of the HTTP server is answered as."""
    for kind in type(refusal).__mro__:
        mapped = _REFUSALS.get(kind)
        if mapped is not None:
            return mapped(refusal.message)
    return RouterError(refusal.message)


def answer_refusal(refusal: Refusal) -> RefusalAnswer:
    """The router's answer to a request its HTTP server refused (`serve_http`'s hook)."""
    error = as_router_error(refusal)
    return error.status, [JSON_CONTENT_TYPE, *error.headers()], error.body()

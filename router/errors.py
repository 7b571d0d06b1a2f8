"""The router's error tree. Each error maps to exactly one HTTP answer, here and nowhere else."""

from __future__ import annotations

import math

import orjson


class RouterError(Exception):
    """An error the client is told about, OpenAI-shaped: {"error": {message, type, code}}."""

    status = 500
    type = "internal_error"
    code = "internal_error"

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


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


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


class ModelNotFound(RouterError):
    """No worker of any role or status is registered for the model."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NoAvailableWorkers(RouterError):
    """Workers for the model exist, but a leg the request needs has none that can take it."""

    status = 503
    type = "service_unavailable"
    code = "no_available_workers"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        seconds = max(1, math.ceil(self.retry_after_s))
        return [(b"retry-after", str(seconds).encode())]


class WorkerUnreachable(RouterError):
    """Every attempt failed before any worker answered."""

    status = 502
    type = "bad_gateway"
    code = "worker_unreachable"


class RequestTimeout(RouterError):
    """The client took too long to send its request head or body (slowloris)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class HeadersTooLarge(RouterError):
    """The request line and headers are over the server's limit."""

    status = 431
    type = "invalid_request_error"
    code = "request_headers_too_large"


class ServerBusy(RouterError):
    """The server is at its connection cap; the connection is answered and closed."""

    status = 503
    type = "service_unavailable"
    code = "server_busy"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", b"1")]


class RouterOverloaded(RouterError):
    """The router itself ran short (file descriptors, local ports, a worker's connection
    cap): no worker is at fault, and the client may retry shortly. `kind` names the
    shortage, as `router_local_errors_total{kind}` counts it."""

    status = 503
    type = "service_unavailable"
    code = "router_overloaded"

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", b"1")]

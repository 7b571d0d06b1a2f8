"""The API surface: the routes table, the one error tree of answers the client is told, and each API's error shape."""

from router.api.error_shapes import STREAM_ERROR_EVENTS, error_body
from router.api.errors import (
    JSON_CONTENT_TYPE,
    BadRequest,
    Conflict,
    InvalidApiKey,
    InvalidPriority,
    InvalidTenant,
    MethodNotAllowed,
    ModelNotFound,
    NoAvailableWorkers,
    NotFound,
    PriorityNotAllowed,
    QueueFull,
    QueueTimeout,
    RouterError,
    RouterOverloaded,
    WorkerUnreachable,
    answer_refusal,
)
from router.api.routes import ROUTES, Dialect, Route

__all__ = [
    "JSON_CONTENT_TYPE",
    "ROUTES",
    "STREAM_ERROR_EVENTS",
    "BadRequest",
    "Conflict",
    "Dialect",
    "InvalidApiKey",
    "InvalidPriority",
    "InvalidTenant",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoAvailableWorkers",
    "NotFound",
    "PriorityNotAllowed",
    "QueueFull",
    "QueueTimeout",
    "Route",
    "RouterError",
    "RouterOverloaded",
    "WorkerUnreachable",
    "answer_refusal",
    "error_body",
]

"""The client-facing HTTP/1.1 server on trio: requests parsed by llhttp and checked by our framing, answers written by our code, limits and timeouts, graceful shutdown, and the optional ASGI front."""

from router.http.server.asgi import serve_asgi
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
from router.http.server.load import ServerLoad
from router.http.server.loop import serve_http
from router.http.server.messages import (
    ClientDisconnected,
    Handler,
    Headers,
    Request,
    ResponseWriter,
)
from router.http.server.settings import ServerSettings

__all__ = [
    "AtCapacity",
    "BodyTooLarge",
    "ClientDisconnected",
    "ClientTooSlow",
    "Handler",
    "HandlerFailed",
    "HeadTooLarge",
    "Headers",
    "MalformedRequest",
    "Refusal",
    "RefusalAnswer",
    "Request",
    "ResponseWriter",
    "ServerLoad",
    "ServerSettings",
    "serve_asgi",
    "serve_http",
]

"""What the server refuses on its own, before or instead of a handler, as its own exceptions.

The server decides *that* it refuses and why; it does not decide what the answer's body
looks like. Whoever starts it passes an `answer_refusal` that turns each refusal into a
status, headers and body (the router's maps them to its error tree:
`router.api.errors.answer_refusal`). Without one, a refusal is answered in plain text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

__all__ = [
    "AnswerRefusal",
    "AtCapacity",
    "BodyTooLarge",
    "ClientTooSlow",
    "HandlerFailed",
    "HeadTooLarge",
    "MalformedRequest",
    "Refusal",
    "RefusalAnswer",
    "plain_refusal",
]


class Refusal(Exception):
    """A request the server answers itself; `status` is what HTTP says of it."""

    # A class variable, so that each subclass's own value is read (see api/errors.py).
    status: ClassVar[int] = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MalformedRequest(Refusal):
    """The request cannot be parsed, or its framing cannot be trusted (the connection closes)."""

    status = 400


class ClientTooSlow(Refusal):
    """The head or the body took longer than the server waits for it."""

    status = 408


class BodyTooLarge(Refusal):
    """The body is over the limit the server was given."""

    status = 413


class HeadTooLarge(Refusal):
    """The request line and headers are over the server's limit."""

    status = 431


class HandlerFailed(Refusal):
    """The handler raised, or finished without answering, before anything was sent."""

    status = 500


class AtCapacity(Refusal):
    """The server is at its connection cap or its body budget; the client may retry soon."""

    status = 503


RefusalAnswer = tuple[int, list[tuple[bytes, bytes]], bytes]
AnswerRefusal = Callable[[Refusal], RefusalAnswer]


def plain_refusal(refusal: Refusal) -> RefusalAnswer:
    """The refusal's message as plain text, `Retry-After: 1` where the server is full."""
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if isinstance(refusal, AtCapacity):
        headers.append((b"retry-after", b"1"))
    return refusal.status, headers, refusal.message.encode() + b"\n"

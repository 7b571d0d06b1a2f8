"""What can go wrong with a worker's connection, as the layers above the socket see it."""

from __future__ import annotations

__all__ = ["UpstreamConnectError", "UpstreamError", "UpstreamProtocolError"]


class UpstreamError(Exception):
    """The upstream exchange failed; `response_started` says whether any response byte arrived.

    Before the first response byte the request may be sent elsewhere; after it, the worker
    has begun to answer and the failure belongs to this attempt.
    """

    def __init__(self, message: str, *, response_started: bool = False) -> None:
        super().__init__(message)
        self.response_started = response_started


class UpstreamConnectError(UpstreamError):
    """No connection could be made: refused, unresolvable, unreachable, or a scheme we lack."""


class UpstreamProtocolError(UpstreamError):
    """The connection broke or the answer was not valid HTTP/1.1: reset, early EOF, garbage."""

"""What can go wrong with a worker's connection, as the layers above the socket see it."""

from __future__ import annotations

import errno
from typing import Final

__all__ = [
    "LOCAL_ERRNO_KINDS",
    "POOL_WAIT_KIND",
    "LocalShortage",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    "local_errno_kind",
]


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


class UpstreamTimeout(UpstreamError):
    """What the caller waited for (the response head, body bytes) did not come by its
    deadline; the connection was closed."""


LOCAL_ERRNO_KINDS: Final[dict[int, str]] = {
    errno.EMFILE: "emfile",
    errno.ENFILE: "enfile",
    errno.ENOBUFS: "enobufs",
    errno.EADDRNOTAVAIL: "eaddrnotavail",
}
POOL_WAIT_KIND: Final = "pool_wait_timeout"


class LocalShortage(Exception):
    """The router ran short of a local resource; `kind` names which (a metric label)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def local_errno_kind(exc: BaseException) -> str | None:
    """The local shortage behind `exc`, if any: its errno, its cause or context, or any
    leaf of an exception group (trio reports several failed connect attempts as one
    `OSError` caused by a group)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in LOCAL_ERRNO_KINDS:
            return LOCAL_ERRNO_KINDS[current.errno]
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                stack.append(linked)
    return None

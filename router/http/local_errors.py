"""The router's own shortages on the upstream side, told apart from a worker's faults.

A connect that fails because this process is out of file descriptors (`EMFILE`), the
host is (`ENFILE`), the kernel has no buffers (`ENOBUFS`) or no local port is left
(`EADDRNOTAVAIL`) says nothing about the worker: counting it against the worker's breaker
would trip every breaker at once and turn a local overload into a fleet-wide outage.
Neither does a checkout that waited its whole connect timeout for one of the worker's
capped connections. These raise `LocalShortage`, which is not an `UpstreamError`.
"""

from __future__ import annotations

import errno

__all__ = ["LOCAL_ERRNO_KINDS", "POOL_WAIT_KIND", "LocalShortage", "local_errno_kind"]

LOCAL_ERRNO_KINDS: dict[int, str] = {
    errno.EMFILE: "emfile",
    errno.ENFILE: "enfile",
    errno.ENOBUFS: "enobufs",
    errno.EADDRNOTAVAIL: "eaddrnotavail",
}
POOL_WAIT_KIND = "pool_wait_timeout"


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

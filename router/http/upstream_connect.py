"""Opening one connection to a worker, with the failures told apart.

A worker that refuses or cannot be reached is the worker's trouble
(`UpstreamConnectError`); one that does not answer within the connect deadline too
(`UpstreamConnectTimeout`). A connect that fails because the router itself has no file
descriptor, buffer or local port left is the router's own (`LocalShortage`).
"""

from __future__ import annotations

import math

import trio

from router.http.local_errors import LocalShortage, local_errno_kind
from router.http.upstream_connection import UpstreamConnection
from router.http.upstream_errors import UpstreamConnectError

__all__ = ["UpstreamConnectTimeout", "open_upstream_connection"]


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection was made within the caller's connect deadline."""


async def open_upstream_connection(
    host: str, port: int, base_url: str, timeout_s: float | None
) -> UpstreamConnection:
    """A new connection to `host:port` (the worker at `base_url`), within `timeout_s`.

    Cancellation: any half-made connection is closed by trio.
    """
    # A connect that hangs (a SYN dropped by a full backlog or a firewall) would otherwise
    # eat the whole first-byte deadline, which is sized for a slow prefill, not for a
    # worker that is not there.
    with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as deadline:
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            kind = local_errno_kind(exc)
            if kind is not None:
                raise LocalShortage(
                    kind,
                    f"cannot connect to {base_url}: the router is short of local resources "
                    f"({kind}): {exc}",
                ) from exc
            raise UpstreamConnectError(f"cannot connect to {base_url}: {exc}") from exc
    if deadline.cancelled_caught:
        raise UpstreamConnectTimeout(
            f"cannot connect to {base_url}: no connection within {timeout_s:g}s"
        )
    return UpstreamConnection(stream)

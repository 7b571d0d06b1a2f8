"""What the native server holds at this moment: connections, turn-away answers and buffered
request-body bytes, with the global budget those bytes are taken from.

The server updates it; the router's metrics read it at scrape time
(`router_client_connections`, `router_client_turn_away_tasks`,
`router_buffered_body_bytes`). Nothing here blocks: the budget refuses at once.
"""

from __future__ import annotations

from router.http.server.exceptions import AtCapacity

__all__ = ["BodyReservation", "ServerLoad"]


class ServerLoad:
    """Counters of one `serve_http` call, and its buffered-body budget of `body_limit` bytes."""

    __slots__ = ("body_bytes", "body_limit", "connections", "turning_away")

    def __init__(self, body_limit: int) -> None:
        self.body_limit = body_limit
        self.body_bytes = 0
        self.connections = 0
        self.turning_away = 0

    def reservation(self) -> BodyReservation:
        """An empty share of the budget, for the body of one request."""
        return BodyReservation(self)


class BodyReservation:
    """The budget bytes one request body holds; `release()` gives them all back.

    The owner calls `release()` in a `finally` (done, refused, client gone, cancelled).
    """

    __slots__ = ("_load", "held")

    def __init__(self, load: ServerLoad) -> None:
        self._load = load
        self.held = 0

    def take(self, size: int) -> None:
        """Hold `size` more bytes, or raise AtCapacity (503, Retry-After) holding nothing more."""
        load = self._load
        if load.body_bytes + size > load.body_limit:
            raise AtCapacity(
                "the server buffers request bodies up to its limit of "
                f"{load.body_limit} bytes at once; retry shortly"
            )
        load.body_bytes += size
        self.held += size

    def release(self) -> None:
        """Give back every byte held (idempotent)."""
        self._load.body_bytes -= self.held
        self.held = 0

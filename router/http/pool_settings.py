"""The upstream pool's settings and the figures it reports: small value objects."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolSettings", "PoolStatistics"]


@dataclass(frozen=True, slots=True)
class PoolSettings:
    max_idle_per_worker: int = 256
    """Idle connections kept per worker; a connection returned beyond it is closed."""
    idle_expiry_s: float = 4.0
    """Idle connections older than this are closed (uvicorn closes idle ones after 5 s)."""
    sweep_interval_s: float = 1.0
    max_connections_per_worker: int = 256
    """Open connections per worker (connecting, in use and idle); checkouts beyond it wait."""


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    idle_per_worker: dict[str, int]
    idle_total: int
    in_use: int
    """Connections checked out by a request right now."""
    opened: int
    closed: int
    reused: int
    """Checkouts served from the pool."""
    stale_discarded: int
    """Pooled connections found closed (or unexpectedly readable) at checkout, before any
    request was written on them, and discarded."""
    waiting: int
    """Checkouts waiting in line for a worker at its connection cap."""
    local_errors: dict[str, int]
    """Checkouts refused for want of a local resource, by kind (`emfile`, ...,
    `pool_wait_timeout`)."""

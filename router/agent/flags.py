"""The registration and drain flags `router agent` and `router fake-worker --register` share,
declared once and read into checked values, so both commands spell, default and refuse
them the same way.

Each command adds its own way to name etcd (`--etcd-endpoint`, `--register`) and says
what the advertised host is without the flag; the rest is here. The help names each
default through argparse's `%(default)s`, so the number is written once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Protocol

from router.agent.drain import DrainSettings
from router.agent.registration import DEFAULT_LEASE_TTL_S, DEFAULT_PREFIX


class FlagGroup(Protocol):
    """An argparse parser or one of its argument groups."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class RegistrationFlags:
    """What the shared flags say, checked."""

    etcd_prefix: str
    advertise_host: str | None
    worker_id: str | None
    lease_ttl_s: int
    drain: DrainSettings


def add_registration_flags(group: FlagGroup, *, advertise_default: str) -> None:
    """Add the key prefix, the advertised identity, the lease and the drain flags.

    `advertise_default` says in the help what the advertised host is without the flag."""
    group.add_argument(
        "--etcd-prefix",
        default=DEFAULT_PREFIX,
        help="key prefix of worker records (default %(default)s)",
    )
    group.add_argument(
        "--advertise-host",
        default=None,
        help=f"host routers reach the engine at (default {advertise_default})",
    )
    group.add_argument(
        "--worker-id", default=None, help="worker id and key suffix (default advertised host:port)"
    )
    group.add_argument(
        "--lease-ttl-s",
        type=int,
        default=DEFAULT_LEASE_TTL_S,
        help="lease TTL in seconds; heartbeats every third of it (default %(default)s)",
    )
    group.add_argument(
        "--drain-settle-s",
        type=float,
        default=6.0,
        help="on SIGTERM, zero load must hold this long (default %(default)s)",
    )
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=300.0,
        help="the drain gives up after this long (default %(default)s)",
    )
    group.add_argument(
        "--drain-poll-s",
        type=float,
        default=0.5,
        help="seconds between /metrics readings (default %(default)s)",
    )


def registration_flags(args: argparse.Namespace) -> RegistrationFlags:
    """The shared flags of `args`, checked; a ValueError names the flag that is wrong."""
    if args.lease_ttl_s < 1:
        raise ValueError(f"--lease-ttl-s must be >= 1, got {args.lease_ttl_s}")
    if not args.drain_poll_s > 0:
        raise ValueError(f"--drain-poll-s must be > 0, got {args.drain_poll_s}")
    if not args.drain_settle_s >= 0:
        raise ValueError(f"--drain-settle-s must be >= 0, got {args.drain_settle_s}")
    if not args.drain_timeout_s > 0:
        raise ValueError(f"--drain-timeout-s must be > 0, got {args.drain_timeout_s}")
    return RegistrationFlags(
        etcd_prefix=args.etcd_prefix,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id,
        lease_ttl_s=args.lease_ttl_s,
        drain=DrainSettings(
            poll_interval_s=args.drain_poll_s,
            settle_s=args.drain_settle_s,
            timeout_s=args.drain_timeout_s,
        ),
    )

"""`router fake-worker --register etcd://HOST:PORT`: the fake registers and drains itself
through the agent's own code (`run_registered`), reading its own `/metrics` the way the
agent reads an engine's, so a test of the fake's drain is a test of the agent's.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

import httpx

from router.agent.advertise import (
    advertised_url,
    etcd_endpoint_url,
    loopback_warning,
    worker_record,
)
from router.agent.drain import DrainSettings, read_engine_load
from router.agent.registration import DEFAULT_LEASE_TTL_S, DEFAULT_PREFIX, run_registered
from router.fake_worker.settings import FakeWorkerSettings

log = logging.getLogger("router.fake_worker.registration")
_UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::")


@dataclass(frozen=True, slots=True)
class FakeRegistration:
    etcd_endpoint: str
    prefix: str
    advertise_host: str | None
    worker_id: str | None
    lease_ttl_s: int
    drain: DrainSettings


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("registration in etcd (as `router agent` does it)")
    group.add_argument(
        "--register",
        metavar="etcd://HOST:PORT",
        default=None,
        help="register in this etcd; drain on SIGTERM",
    )
    group.add_argument(
        "--etcd-prefix", default=DEFAULT_PREFIX, help=f"key prefix (default {DEFAULT_PREFIX})"
    )
    group.add_argument(
        "--advertise-host", default=None, help="host routers reach this worker at (default: --host)"
    )
    group.add_argument(
        "--worker-id", default=None, help="worker id (default: advertised host:port)"
    )
    group.add_argument(
        "--lease-ttl-s",
        type=int,
        default=DEFAULT_LEASE_TTL_S,
        help=f"lease TTL (default {DEFAULT_LEASE_TTL_S})",
    )
    group.add_argument(
        "--drain-settle-s",
        type=float,
        default=6.0,
        help="zero load must hold this long (default 6)",
    )
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=300.0,
        help="drain gives up after this (default 300)",
    )
    group.add_argument(
        "--drain-poll-s",
        type=float,
        default=0.5,
        help="seconds between own /metrics readings (default 0.5)",
    )


def registration_options(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> FakeRegistration | None:
    """The registration flags of `argv` (None without `--register`); exits with status 2
    and a usage message when one is invalid."""
    args = parser.parse_args(list(argv))
    if args.register is None:
        return None
    try:
        if args.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s must be >= 1, got {args.lease_ttl_s}")
        return FakeRegistration(
            etcd_endpoint=etcd_endpoint_url(args.register),
            prefix=args.etcd_prefix,
            advertise_host=args.advertise_host,
            worker_id=args.worker_id,
            lease_ttl_s=args.lease_ttl_s,
            drain=DrainSettings(
                poll_interval_s=args.drain_poll_s,
                settle_s=args.drain_settle_s,
                timeout_s=args.drain_timeout_s,
            ),
        )
    except ValueError as exc:
        parser.error(str(exc))


async def register_and_drain(
    options: FakeRegistration,
    settings: FakeWorkerSettings,
    url: str,
    signals: AsyncIterator[int],
) -> None:
    """Register the fake worker serving at `url`; on the first signal drain and deregister.

    The worker keeps serving meanwhile (in-flight requests and any that still arrive);
    this returns once it is deregistered, or at once when a signal came before it was
    registered, and the caller then stops the server.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per etcd call
    port = urlsplit(url).port
    assert port is not None, "the server reports its bound URL"
    host = options.advertise_host or (
        socket.gethostname() if settings.host in _UNSPECIFIED_HOSTS else settings.host
    )
    record = worker_record(
        worker_id=options.worker_id or f"{host}:{port}",
        url=advertised_url(url, host),
        model=settings.model,
        role=settings.role,
        engine=settings.engine,
        dp_size=settings.dp_size,
        bootstrap_port=settings.bootstrap_port if settings.role == "prefill" else None,
        pd_protocol=settings.pd_protocol,
    )
    warning = loopback_warning(host, options.etcd_endpoint)
    if warning:
        log.warning("%s", warning)
    own = (
        "127.0.0.1"
        if settings.host in _UNSPECIFIED_HOSTS
        else urlsplit(url).netloc.rsplit(":", 1)[0]
    )
    metrics_url = f"http://{own}:{port}/metrics"
    async with httpx.AsyncClient(timeout=5.0) as http:
        await run_registered(
            options.etcd_endpoint,
            options.prefix,
            record,
            lease_ttl_s=options.lease_ttl_s,
            read_load=partial(read_engine_load, http, metrics_url, settings.engine),
            drain_settings=options.drain,
            signals=signals,
        )

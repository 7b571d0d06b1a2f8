"""`router fake-worker --register etcd://HOST:PORT`: the fake registers and drains itself
through the agent's own code (`run_registered`), reading its own `/metrics` the way the
agent reads an engine's, so a test of the fake's drain is a test of the agent's.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import AsyncIterator
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
from router.agent.drain import read_engine_load
from router.agent.flags import RegistrationFlags, add_registration_flags, registration_flags
from router.agent.registration import run_registered
from router.fake_worker.settings import FakeWorkerSettings
from router.observability.logs import configure_logging

log = logging.getLogger("router.fake_worker.registration")
_UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::")


@dataclass(frozen=True, slots=True)
class FakeRegistration:
    etcd_endpoint: str
    flags: RegistrationFlags


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("registration in etcd (as `router agent` does it)")
    group.add_argument(
        "--register",
        metavar="etcd://HOST:PORT",
        default=None,
        help="register in this etcd; drain on SIGTERM",
    )
    add_registration_flags(group, advertise_default="--host")


def registration_options(args: argparse.Namespace) -> FakeRegistration | None:
    """The registration flags of `args` (None without `--register`), checked; a
    ValueError names the flag that is wrong."""
    if args.register is None:
        return None
    return FakeRegistration(etcd_endpoint_url(args.register), registration_flags(args))


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
        configure_logging(logging.INFO)
    port = urlsplit(url).port
    assert port is not None, "the server reports its bound URL"
    flags = options.flags
    host = flags.advertise_host or (
        socket.gethostname() if settings.host in _UNSPECIFIED_HOSTS else settings.host
    )
    record = worker_record(
        worker_id=flags.worker_id or f"{host}:{port}",
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
            flags.etcd_prefix,
            record,
            lease_ttl_s=flags.lease_ttl_s,
            read_load=partial(read_engine_load, http, metrics_url, settings.engine),
            drain_settings=flags.drain,
            signals=signals,
        )

"""What a worker tells routers about itself: the address they reach it at, and its record.

A worker usually listens on loopback or on every interface; routers elsewhere must be given
an address they can reach, so the advertised URL swaps in `--advertise-host` and keeps the
engine URL's scheme, port and path.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from router.fleet.records import WorkerRecord, disagg_meta


def etcd_endpoint_url(endpoint: str) -> str:
    """An etcd client URL from `etcd://host:port`, `http(s)://host:port` or `host:port`."""
    if endpoint.startswith("etcd://"):
        endpoint = "http://" + endpoint.removeprefix("etcd://")
    elif "://" not in endpoint:
        endpoint = "http://" + endpoint
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"etcd endpoint must look like etcd://HOST:PORT, got {endpoint!r}")
    return endpoint.rstrip("/")


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (so no other machine can reach it there)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_warning(advertise_host: str, etcd_endpoint: str) -> str | None:
    """A warning when routers elsewhere would read an address that points at themselves:
    the advertised host is loopback while etcd (so its readers) is not."""
    etcd_host = urlsplit(etcd_endpoint).hostname or ""
    if is_loopback(advertise_host) and not is_loopback(etcd_host):
        return (
            f"the advertised host {advertise_host} is a loopback address but etcd "
            f"({etcd_host}) is not: routers on other machines will connect to themselves. "
            "Pass --advertise-host with an address they can reach."
        )
    return None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_url(engine_url: str, advertise_host: str) -> str:
    """`engine_url` with its host replaced by `advertise_host` (scheme, port, path kept)."""
    parts = urlsplit(engine_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL must be http(s)://HOST:PORT, got {engine_url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{_host_port(advertise_host, port)}{parts.path.rstrip('/')}"


def worker_record(
    *,
    worker_id: str,
    url: str,
    model: str,
    role: str,
    engine: str | None,
    dp_size: int = 1,
    dp_rank: int | None = None,
    bootstrap_port: int | None = None,
    pd_protocol: str = "mooncake",
    adapters: tuple[str, ...] = (),
) -> WorkerRecord:
    """The record a worker registers; a prefill advertises `bootstrap_port` on its URL's
    host. Invalid fields raise `InvalidWorkerRecord` (a ValueError) naming the field."""
    data: dict[str, Any] = {
        "id": worker_id,
        "url": url,
        "model": model,
        "role": role,
        "engine": engine,
        "dp_size": dp_size,
        "dp_rank": dp_rank,
    }
    if adapters:
        data["adapters"] = list(adapters)
    if bootstrap_port is not None:
        host = urlsplit(url).hostname or "127.0.0.1"
        data["disagg_meta"] = disagg_meta(host, bootstrap_port, pd_protocol)
    return WorkerRecord.from_json(data)

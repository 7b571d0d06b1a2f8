"""A worker's base URL, checked once against what the upstream pool can send.

The pool speaks plain HTTP/1.1 over TCP and writes the request line and `host` header in
ASCII. A URL it cannot use must be refused where the worker record is parsed (a static
worker stops `router serve`, a discovery record is skipped), not on every request later.

The rules: scheme `http`, or `grpc` for an engine's gRPC service (`router.http.grpc`);
no TLS to workers (a worker behind TLS needs a local proxy or a sidecar); an ASCII host
name or IP literal; a port from 1 to 65535 (default 80; a `grpc://` URL names its port);
for `http`, a path prefix of visible ASCII characters without spaces or controls, and
for `grpc` no path at all (a gRPC method is its own path); no user name or password, no
query and no fragment (the router appends each request's own path to the prefix, so none
of them would mean anything a worker could rely on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

__all__ = ["InvalidWorkerUrl", "WorkerAddress", "is_grpc_url", "parse_worker_url"]

# Letters, digits, dots, dashes, underscores (some engines' hostnames carry them), or a
# bracketed IPv6 literal.
_HOST: Final = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
# Visible ASCII, no space: what a request target may carry (RFC 9112 section 3.2).
_PATH: Final = re.compile(r"[!-~]*")


class InvalidWorkerUrl(ValueError):
    """A worker URL the pool cannot use; the message says why."""


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """Where the pool connects and what it writes for one worker."""

    host: str
    """For connecting: an IPv6 literal without its brackets."""
    port: int
    host_header: bytes
    """The `host` header: the URL's host and port as written."""
    prefix: str
    """The URL's path without a trailing slash; prepended to every request target."""
    protocol: str = "http"
    """`http` (the upstream pool's HTTP/1.1) or `grpc` (the gRPC pool's HTTP/2)."""


def parse_worker_url(url: str) -> WorkerAddress:
    """The address of a worker URL, or InvalidWorkerUrl saying what is wrong with it."""
    if not url.isascii() or any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise InvalidWorkerUrl(
            f"worker URL {url!r} must be ASCII without spaces or control characters"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidWorkerUrl(f"worker URL {url!r} is malformed: {exc}") from None
    if parts.scheme in ("https", "grpcs"):
        raise InvalidWorkerUrl(
            f"worker URL {url!r}: TLS to workers is not supported; use http:// or grpc:// "
            "(a worker behind TLS needs a local plain-text proxy)"
        )
    if parts.scheme not in ("http", "grpc"):
        raise InvalidWorkerUrl(f"worker URL {url!r} must start with http:// or grpc://")
    netloc = parts.netloc
    if "@" in netloc:
        raise InvalidWorkerUrl(f"worker URL {url!r} must not carry a user name or password")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise InvalidWorkerUrl(f"worker URL {url!r} must not carry a query or a fragment")
    host_part = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
    if not parts.hostname or _HOST.fullmatch(host_part) is None:
        raise InvalidWorkerUrl(f"worker URL {url!r} has no valid host name")
    if port == 0:
        raise InvalidWorkerUrl(f"worker URL {url!r}: port 0 cannot be connected to")
    if _PATH.fullmatch(parts.path) is None:
        raise InvalidWorkerUrl(f"worker URL {url!r} has a path the request line cannot carry")
    if parts.scheme == "grpc":
        if port is None:
            raise InvalidWorkerUrl(f"worker URL {url!r} must name its port (grpc://host:port)")
        if parts.path.strip("/"):
            raise InvalidWorkerUrl(f"worker URL {url!r}: a grpc:// URL has no path")
    return WorkerAddress(
        host=parts.hostname,
        port=port or 80,
        host_header=netloc.encode("ascii"),
        prefix=parts.path.rstrip("/"),
        protocol=parts.scheme,
    )


def is_grpc_url(url: str) -> bool:
    """Whether a (validated) worker URL is served over gRPC."""
    return url.startswith("grpc://")

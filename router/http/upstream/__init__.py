"""The upstream pool: HTTP/1.1 to the workers, one bounded LIFO idle deque per worker, responses parsed by llhttp behind our checks."""

from router.http.upstream.connection import UpstreamConnectTimeout, UpstreamResponse
from router.http.upstream.exceptions import LocalShortage, UpstreamConnectError, UpstreamError
from router.http.upstream.pool import PooledRequest, PoolSettings, UpstreamPool, open_upstream_pool
from router.http.upstream.worker_url import InvalidWorkerUrl, parse_worker_url

__all__ = [
    "InvalidWorkerUrl",
    "LocalShortage",
    "PoolSettings",
    "PooledRequest",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "open_upstream_pool",
    "parse_worker_url",
]

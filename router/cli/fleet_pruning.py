"""What the router lets go of when a worker leaves the fleet.

A fleet that churns (autoscaling, etcd leases expiring, rolling restarts) must not leave
state behind for every worker it ever saw: the upstream pool's endpoint and idle
connections (a gRPC worker's connection and its tokenizer facts), the DP rank rotation, and the per-worker metric series all go with the
worker. The breaker and the in-flight counts live on the `Worker` itself and go with it.
"""

from __future__ import annotations

import logging

from router.fleet.ranks import RankChooser
from router.fleet.registry import Worker
from router.http.grpc import GrpcPool
from router.http.upstream.pool import UpstreamPool
from router.observability.metrics import BreakerMetrics
from router.pipeline.grpc_dispatch import GrpcEngines

log = logging.getLogger("router.fleet")


class DepartedWorkerPruner:
    """A `FleetListener` that prunes a departed worker's state from the router's layers."""

    def __init__(
        self,
        pool: UpstreamPool,
        ranks: RankChooser,
        breakers: BreakerMetrics,
        grpc: GrpcPool | None = None,
        grpc_engines: GrpcEngines | None = None,
    ) -> None:
        self._pool = pool
        self._ranks = ranks
        self._breakers = breakers
        self._grpc = grpc
        self._grpc_engines = grpc_engines

    def worker_left(self, worker: Worker) -> None:
        self._ranks.forget(worker.id)
        self._breakers.forget_worker(worker.id)

    def url_dropped(self, url: str) -> None:
        if url.startswith("grpc://"):
            if self._grpc_engines is not None:
                self._grpc_engines.forget(url)
            if self._grpc is not None and self._grpc.forget(url):
                log.debug("closed the gRPC connection of %s: no worker has it any more", url)
            return
        if self._pool.forget(url):
            log.debug("closed the idle upstream connections of %s: no worker has it any more", url)

"""What the router lets go of when a worker leaves the fleet.

A fleet that churns (autoscaling, etcd leases expiring, rolling restarts) must not leave
state behind for every worker it ever saw: the upstream pool's endpoint and idle
connections, the DP rank rotation, and the per-worker metric series all go with the
worker. The breaker and the in-flight counts live on the `Worker` itself and go with it.
"""

from __future__ import annotations

import logging

from router.fleet.ranks import RankChooser
from router.fleet.registry import Worker
from router.http.upstream.pool import UpstreamPool
from router.observability.metrics import BreakerMetrics

log = logging.getLogger("router.fleet")


class DepartedWorkerPruner:
    """A `FleetListener` that prunes a departed worker's state from the router's layers."""

    def __init__(self, pool: UpstreamPool, ranks: RankChooser, breakers: BreakerMetrics) -> None:
        self._pool = pool
        self._ranks = ranks
        self._breakers = breakers

    def worker_left(self, worker: Worker) -> None:
        self._ranks.forget(worker.id)
        self._breakers.forget_worker(worker.id)

    def url_dropped(self, url: str) -> None:
        if self._pool.forget(url):
            log.debug("closed the idle upstream connections of %s: no worker has it any more", url)

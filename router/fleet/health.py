"""Active health checks: each worker's `/health` (a `grpc://` worker's `HealthCheck`),
with failure and success thresholds.

The checker writes only `Worker.healthy`. It never touches `status` (a worker's own
registration owns that) and never the breaker (inference faults own that).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import trio

from router.fleet.registry import Fleet, Worker

log = logging.getLogger("router.health")


@dataclass(slots=True)
class HealthTracker:
    """Turns a run of check results into a healthy/unhealthy verdict per worker."""

    failure_threshold: int
    success_threshold: int
    _failures: dict[str, int] = field(default_factory=dict)
    _successes: dict[str, int] = field(default_factory=dict)

    def record(self, worker: Worker, passed: bool) -> bool:
        """Record one check; returns True when the worker's `healthy` flag changed."""
        if passed:
            self._failures[worker.id] = 0
            count = self._successes[worker.id] = self._successes.get(worker.id, 0) + 1
            if not worker.healthy and count >= self.success_threshold:
                worker.healthy = True
                return True
        else:
            self._successes[worker.id] = 0
            count = self._failures[worker.id] = self._failures.get(worker.id, 0) + 1
            if worker.healthy and count >= self.failure_threshold:
                worker.healthy = False
                return True
        return False

    def forget_missing(self, fleet: Fleet) -> None:
        known = {worker.id for worker in fleet.workers()}
        for table in (self._failures, self._successes):
            for worker_id in [wid for wid in table if wid not in known]:
                del table[worker_id]


GrpcCheck = Callable[[str, float], Awaitable[bool]]
"""A gRPC worker's health check: its URL and timeout in, whether it said healthy out
(`router.engines.grpc_service.healthy` on the router's gRPC pool)."""


async def check_once(
    http: httpx.AsyncClient, worker: Worker, timeout_s: float, grpc: GrpcCheck | None = None
) -> bool:
    """One GET /health (a `grpc://` worker: one `HealthCheck` through `grpc`, failed
    without one); any transport error or non-2xx is a failed check."""
    if worker.record.is_grpc:
        if grpc is None:
            return False
        with trio.move_on_after(timeout_s):
            return await grpc(worker.url, timeout_s)
        return False
    try:
        response = await http.get(worker.url + "/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.is_success


async def serve_health_checks(
    fleet: Fleet,
    http: httpx.AsyncClient,
    *,
    interval_s: float,
    timeout_s: float,
    failure_threshold: int,
    success_threshold: int,
    grpc: GrpcCheck | None = None,
    task_status: trio.TaskStatus[HealthTracker] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Check every worker each `interval_s`, all checks of a round concurrently.

    Reports ready after the first round, so a router that says it is ready has looked at
    its fleet once. Runs until cancelled.
    """
    tracker = HealthTracker(failure_threshold, success_threshold)

    async def check(worker: Worker) -> None:
        passed = await check_once(http, worker, timeout_s, grpc)
        if tracker.record(worker, passed):
            if worker.healthy:
                log.info("worker %s is healthy again", worker.id)
            else:
                log.warning(
                    "worker %s is unhealthy: /health failed %d times in a row",
                    worker.id,
                    failure_threshold,
                )

    first = True
    while True:
        async with trio.open_nursery() as nursery:
            for worker in fleet.workers():
                nursery.start_soon(check, worker)
        tracker.forget_missing(fleet)
        if first:
            task_status.started(tracker)
            first = False
        await trio.sleep(interval_s)

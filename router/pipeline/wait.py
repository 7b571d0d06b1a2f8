"""Waiting for a worker: a request whose model has no worker free right now waits, in line.

Two reasons to wait instead of answering at once:
- every fit worker of the model is at its in-flight cap (`--worker-max-inflight`): the
  request waits for a slot, at most `--queue-timeout-s`, then 503 `queue_timeout`;
- with `--wait-for-workers-s`, every worker is unavailable (restarting, DRAINING,
  unhealthy, breaker-open under `reject`) or the model's last worker just left the fleet
  (a rolling update): the request waits that long for one to come back, then gets the
  truthful 503 (or 404 for a model that stayed gone).

Each model has its own FIFO line. Only the head of a line plans; a newcomer joins the
tail while anyone waits, so nobody overtakes. A finishing request wakes the head of each
of its worker's models at once; everything else that can bring a worker back (health,
breaker cooldown, discovery) is noticed by the head re-planning every `recheck_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.api.errors import ModelNotFound, NoAvailableWorkers, QueueTimeout
from router.fleet.candidates import AllOpenMode
from router.fleet.registry import Fleet, Worker
from router.http import clock
from router.pipeline.plan import Plan


@dataclass(frozen=True, slots=True)
class WorkerWaitSettings:
    capacity_wait_s: float
    """How long a request waits for a slot on a worker at its cap (the queue timeout)."""
    workers_wait_s: float = 0.0
    """How long a request waits for an unavailable or departed worker; 0: not at all."""
    recheck_s: float = 0.1
    all_open: AllOpenMode = AllOpenMode.DISPATCH
    retry_after_s: float = 1.0


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = trio.Event()


class WorkerWait:
    """Plans a request's first attempt, waiting in the model's line when that is worth it."""

    def __init__(self, fleet: Fleet, settings: WorkerWaitSettings) -> None:
        self.fleet = fleet
        self.settings = settings
        self._lines: dict[str, dict[_Waiter, None]] = {}
        self._recent: dict[str, float] = {}
        self._known: set[str] = set()
        self._seen_generation = -1
        self.outcomes = {"served": 0, "timed_out": 0, "client_left": 0}

    def waiting(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def has_line(self, model: str) -> bool:
        """Whether requests wait for `model` now (a newcomer would join behind them)."""
        return bool(self._lines.get(model))

    def notify(self, worker: Worker) -> None:
        """A request on `worker` ended: the head of each of its models' lines may go."""
        for model in (*worker.record.models, *worker.adapters.held):
            line = self._lines.get(model)
            if line:
                next(iter(line)).event.set()

    async def plan(self, model: str, plan_at: Callable[[float], Plan]) -> Plan:
        """The plan for a request's first attempt, now or after waiting in line.

        `plan_at(now)` plans the request (`router.pipeline.plan.plan_request` with the
        request's own parameters). Raises what it raises once waiting is pointless or over, or
        QueueTimeout when a slot on a capped worker did not free up in time.
        Cancellation (the client left): the request leaves the line; the next one is woken.
        """
        now = clock.now()
        self._remember_models(now)
        if not self._lines.get(model):
            try:
                return plan_at(now)
            except (ModelNotFound, NoAvailableWorkers) as error:
                if self._wait_for(model, error, now) <= 0:
                    raise
        return await self._wait_in_line(model, now, plan_at)

    def _wait_for(self, model: str, error: Exception, now: float) -> float:
        """How long, from the first failure, a request may wait for `model` (0: not at all)."""
        settings = self.settings
        if isinstance(error, NoAvailableWorkers) and self._at_capacity(model):
            return max(settings.capacity_wait_s, settings.workers_wait_s)
        if settings.workers_wait_s <= 0:
            return 0.0
        if isinstance(error, ModelNotFound):
            # A model the fleet served a moment ago is being replaced, not unknown.
            last_seen = self._recent.get(model)
            return (
                settings.workers_wait_s
                if last_seen is not None and now - last_seen <= settings.workers_wait_s
                else 0.0
            )
        return settings.workers_wait_s

    def _at_capacity(self, model: str) -> bool:
        return any(
            worker.full and worker.healthy and not worker.draining
            for worker in self.fleet.for_model(model)
        )

    async def _wait_in_line(
        self, model: str, started: float, plan_at: Callable[[float], Plan]
    ) -> Plan:
        line = self._lines.setdefault(model, {})
        me = _Waiter()
        line[me] = None
        settings = self.settings
        deadline = started + max(settings.capacity_wait_s, settings.workers_wait_s)
        try:
            while True:
                head = next(iter(line)) is me
                with trio.move_on_at(
                    min(deadline, clock.now() + settings.recheck_s) if head else deadline
                ):
                    await me.event.wait()
                me.event = trio.Event()
                now = clock.now()
                if next(iter(line)) is not me and now < deadline:
                    continue
                # The head plans; so does a waiter whose time is up, to give the true answer.
                self._remember_models(now)
                try:
                    plan = plan_at(now)
                except (ModelNotFound, NoAvailableWorkers) as error:
                    allowed = self._wait_for(model, error, now)
                    if allowed <= 0 or now >= started + allowed or now >= deadline:
                        raise self._timed_out(model, error) from None
                    continue
                self.outcomes["served"] += 1
                return plan
        except trio.Cancelled:
            self.outcomes["client_left"] += 1
            raise
        finally:
            del line[me]
            if line:
                next(iter(line)).event.set()
            else:
                self._lines.pop(model, None)

    def _timed_out(self, model: str, error: Exception) -> Exception:
        self.outcomes["timed_out"] += 1
        if isinstance(error, NoAvailableWorkers) and self._at_capacity(model):
            return QueueTimeout(
                f"waited {self.settings.capacity_wait_s:g}s for a free worker of model '{model}'",
                self.settings.retry_after_s,
                limit="worker_inflight",
            )
        return error

    def _remember_models(self, now: float) -> None:
        """Note when each model was last served by the fleet, whenever the fleet changed.

        Checked on each request (an integer compare), so a departure is noticed by the
        first request after it. Entries older than the wait are dropped: the map holds only
        models served within the last `workers_wait_s`.
        """
        if self.settings.workers_wait_s <= 0 or self.fleet.generation == self._seen_generation:
            return
        self._seen_generation = self.fleet.generation
        # Models served before this change were served until now, including departed ones.
        for model in self._known:
            self._recent[model] = now
        self._known = {*self.fleet.models(), *self.fleet.adapters()}
        for model in self._known:
            self._recent[model] = now
        horizon = now - self.settings.workers_wait_s
        for model in [name for name, seen in self._recent.items() if seen < horizon]:
            del self._recent[model]


class WorkerWaitCollector(Collector):
    """Requests waiting for a worker now, and how past waits ended."""

    def __init__(self, wait: WorkerWait) -> None:
        self._wait = wait

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(
            "router_worker_wait_depth",
            "Requests waiting for a worker of their model to be free or back",
            value=self._wait.waiting(),
        )
        ended = CounterMetricFamily(
            "router_worker_waits", "Waits for a worker, by how they ended", labels=["outcome"]
        )
        for outcome, count in self._wait.outcomes.items():
            ended.add_metric([outcome], count)
        yield ended

"""The attempt loop: plan, pick, dispatch, and fail over to another worker.

One request = one call of `GenerationService.handle`, inside the nursery the server gave
the request. Each attempt picks a worker the request has not tried, takes the worker's
breaker permit at the moment of dispatch, and records exactly one verdict for it. A
pre-first-byte failure goes back to planning; after the first byte nothing is retried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import trio

from router.breaker import Outcome, Permit
from router.cache_aware import CacheAware, CacheAwareSettings
from router.cache_aware_metrics import CacheAwareCollector
from router.classify import Mode, Plan, plan_request
from router.config import Settings
from router.dispatch import (
    JSON_HEADERS,
    Answer,
    AttemptFailed,
    Timeouts,
    client_headers,
    first_stream_chunk,
    judge_answer,
    open_upstream_response,
    read_answer,
    relay_stream,
    upstream_headers,
)
from router.error_shapes import STREAM_ERROR_EVENTS, error_body
from router.errors import RouterError, RouterOverloaded, WorkerUnreachable
from router.generation import GenerationRequest, parse_generation_request
from router.http.messages import ClientDisconnected, Request, ResponseWriter
from router.http.pool import UpstreamPool
from router.metrics import RouterMetrics
from router.pd import PDDispatcher
from router.request_id import current_request_id
from router.routes import ROUTES
from router.routing_text import routing_text
from router.selection import AllOpenMode, PolicyKey, make_policy, pick_excluding, routing_key
from router.tracing import NO_ATTEMPT_TRACE, AttemptTrace, current_trace
from router.worker_record import Role
from router.worker_wait import WorkerWait, WorkerWaitSettings
from router.workers import Fleet, Worker

log = logging.getLogger("router.failover")

STREAM_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
CLIENT_LEFT = 499  # status recorded in metrics for a client that went away


@dataclass(slots=True)
class Lease:
    """One worker taken for one attempt: its breaker permit, its DP rank and its verdict."""

    worker: Worker
    permit: Permit | None
    rank: int | None
    trace: AttemptTrace = NO_ATTEMPT_TRACE
    judged: bool = False
    committed: bool = False
    """Its answer has begun to go to the client: from here on nothing may cancel or retry it."""

    async def commit(self) -> None:
        """Pass the point of no return, unless the attempt was cancelled meanwhile.

        A PD partner's failure cancels this attempt's scope; a task already scheduled to
        resume would otherwise only see that cancellation at its next checkpoint, which can
        be inside the client write, after the response started. Checking here first makes
        "cancelled" and "committed" exclusive.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self.committed = True

    def judge(self, outcome: Outcome) -> None:
        """Record the attempt's one verdict on the worker's breaker (later calls do nothing)."""
        if self.judged:
            return
        self.judged = True
        self.trace.verdict(outcome.name.lower())
        breaker = self.worker.breaker
        if breaker is not None and self.permit is not None:
            breaker.record(self.permit, outcome, trio.current_time())


@dataclass(slots=True)
class AttemptLog:
    tried: dict[Role, set[str]] = field(default_factory=lambda: {role: set() for role in Role})
    last_answer: tuple[Answer, str] | None = None
    reasons: list[str] = field(default_factory=list)


def _untried_left(plan: Plan, attempts: AttemptLog) -> bool:
    """Whether every leg of `plan` still has a candidate the request has not tried.

    Only asked before a retry, so its scan is not on the path of a healthy request.
    """
    return all(
        any(worker.id not in attempts.tried[role] for worker in leg.candidates)
        for role, leg in plan.legs.items()
    )


class GenerationService:
    """Serves the model-keyed routes (`router.routes.ROUTES`): resolve, select, dispatch,
    fail over. Non-generation routes take the same path on a mixed worker."""

    def __init__(self, settings: Settings, fleet: Fleet, pool: UpstreamPool, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.fleet = fleet
        self.pool = pool
        self.metrics = metrics
        cache = CacheAwareSettings(
            cache_threshold=settings.cache_threshold,
            balance_abs_threshold=settings.balance_abs_threshold,
            balance_rel_threshold=settings.balance_rel_threshold,
            max_tree_size=settings.max_tree_size,
        )
        self.policies = {
            Role.MIXED: make_policy(settings.policy, cache=cache),
            Role.PREFILL: make_policy(settings.prefill_policy, cache=cache),
            Role.DECODE: make_policy(settings.decode_policy, cache=cache),
        }
        cache_aware = {role: policy for role, policy in self.policies.items() if isinstance(policy, CacheAware)}
        self.reads_text = bool(cache_aware)
        for policy in cache_aware.values():
            fleet.add_listener(policy)
        # Registered under every policy, so the families exist (empty) whatever is chosen.
        metrics.registry.register(CacheAwareCollector(cache_aware))
        self.all_open = AllOpenMode(settings.breaker_all_open)
        self.timeouts = Timeouts(
            connect_s=settings.connect_timeout_s,
            first_byte_s=settings.first_byte_timeout_s,
            stream_idle_s=settings.stream_idle_timeout_s,
        )
        self.pd = PDDispatcher(self)
        self.waits = WorkerWait(
            fleet,
            WorkerWaitSettings(
                capacity_wait_s=settings.queue_timeout_s,
                workers_wait_s=settings.wait_for_workers_s,
                all_open=self.all_open,
                retry_after_s=settings.retry_after_s,
            ),
        )

    async def handle(self, request: Request, writer: ResponseWriter, key: str | None = None) -> None:
        """Answer one generation request (`key`: the client key's name, for metrics).

        Cancellation (client gone, shutdown): every upstream connection of the request is
        closed, every breaker permit is released without a verdict, in-flight counts drop.
        """
        started = trio.current_time()
        spec = ROUTES[request.path]
        route = spec.label
        model_label = "-"
        status = 500
        try:
            generation = parse_generation_request(
                request.path, request.body, self.fleet.models(), self.settings.max_n
            )
            if self.fleet.for_model(generation.model):
                model_label = generation.model
            status = await self._serve(generation, request, writer, started)
        except RouterError as error:
            status = error.status
            if isinstance(error, RouterOverloaded):
                self.metrics.count_local_error(error.kind)
            await writer.respond(error.status, JSON_HEADERS + error.headers(), error_body(error, spec.dialect))
        except ClientDisconnected:
            status = CLIENT_LEFT
        finally:
            if request.client_gone:
                status = CLIENT_LEFT
            self.metrics.count_request(model_label, route, status, key)
            self.metrics.observe_duration(route, trio.current_time() - started)

    async def _serve(self, generation: GenerationRequest, request: Request, writer: ResponseWriter, started: float) -> int:
        attempts = AttemptLog()
        session = request.header(b"x-session-id")
        key_bytes = routing_key(session, generation.body)
        if self.reads_text:
            generation.routing_text = routing_text(generation.body)
        retry_reason: str | None = None
        for attempt in range(self.settings.max_attempts):
            now = trio.current_time()
            try:
                plan_at = partial(self._plan, generation)
                plan = await self.waits.plan(generation.model, plan_at) if attempt == 0 else plan_at(now)
            except RouterError:
                if attempt == 0:
                    raise
                break  # the fleet changed under a failing request: give the last answer
            if retry_reason is not None:
                if not _untried_left(plan, attempts):
                    break
                # Counted as another worker is about to be tried: a failure that ends the
                # request is no retry, whatever its reason.
                self.metrics.count_retry(retry_reason)
                retry_reason = None
            if attempt == 0 and generation.spec.generation:
                # A request counts once, under the mode it was first planned in.
                self.metrics.child(self.metrics.pd_requests, plan.mode.value).inc()  # type: ignore[attr-defined]
            try:
                if plan.mode is Mode.PD:
                    delivered = await self.pd.attempt(plan, generation, request, writer, key_bytes, attempts, started)
                else:
                    delivered = await self._attempt_mixed(plan, generation, request, writer, key_bytes, attempts, started)
            except AttemptFailed as failure:
                self._note_failure(failure, attempts)
                if not failure.retryable:
                    break
                retry_reason = failure.reason
                continue
            if delivered is None:
                break  # no untried worker left
            return delivered
        return await self._give_up(generation, writer, attempts)

    def _plan(self, generation: GenerationRequest, now: float) -> Plan:
        return plan_request(
            generation.model, self.fleet.for_model(generation.model), now,
            self.all_open, self.settings.retry_after_s,
            self.fleet.last_served_at(generation.model), self.settings.model_memory_s,
            generation.spec.generation,
        )

    def take(
        self, worker: Worker, forced: bool, now: float, rank: int | None, leases: list[Lease]
    ) -> Lease:
        """Take `worker` for one attempt on DP `rank`: its breaker permit now, at dispatch.

        The lease is appended to `leases` the moment it exists, so the caller's `finally:
        release_all(leases)` releases it whatever happens next. The permit is acquired
        here and not when candidates are listed, so the half-open probe slot is only ever
        held by a request that is really sent to that worker.
        """
        permit: Permit | None = None
        if worker.breaker is not None:
            permit = worker.breaker.acquire(now, force=forced)
            if permit is None:
                # Only reachable if selection and dispatch disagree; dispatch forced rather
                # than drop a request the plan admitted.
                permit = worker.breaker.acquire(now, force=True)
            if permit is not None and permit.probe:
                log.info("probing %s: its breaker cooldown is over [request %s]", worker.id, current_request_id())
        lease = Lease(worker, permit, rank, current_trace().attempt(worker))
        worker.begin(rank)
        leases.append(lease)
        return lease

    def credential(self, worker: Worker) -> bytes | None:
        """The `Authorization` value the router sends `worker`, if it holds a key for it."""
        key = worker.record.api_key or self.settings.worker_api_key
        return b"Bearer " + key.encode() if key else None

    def release(self, lease: Lease) -> None:
        """End the lease: a neutral verdict unless one was recorded (which frees a probe
        slot), and the in-flight counts drop, even when the verdict raises."""
        try:
            lease.judge(Outcome.NEUTRAL)
        finally:
            lease.worker.end(lease.rank)
            lease.trace.end()
            self.fleet.lease_ended(lease.worker)
            self.waits.notify(lease.worker)

    def release_all(self, leases: list[Lease]) -> None:
        """Release every lease, each even when releasing another one raised."""
        if leases:
            lease = leases.pop()
            try:
                self.release(lease)
            finally:
                self.release_all(leases)

    def pick(
        self, plan: Plan, role: Role, model: str, key_bytes: bytes | None, attempts: AttemptLog,
        text: str | None = None,
    ) -> Worker | None:
        pool = plan.legs[role]
        return pick_excluding(
            self.policies[role], PolicyKey(model, role, key_bytes, text), pool.candidates, attempts.tried[role]
        )

    async def _attempt_mixed(
        self, plan: Plan, generation: GenerationRequest, request: Request, writer: ResponseWriter,
        key_bytes: bytes | None, attempts: AttemptLog, started: float,
    ) -> int | None:
        worker = self.pick(plan, Role.MIXED, generation.model, key_bytes, attempts, generation.routing_text)
        if worker is None:
            return None
        attempts.tried[Role.MIXED].add(worker.id)
        rank = self.pd.ranks.choose(worker)
        leases: list[Lease] = []
        try:
            lease = self.take(worker, plan.legs[Role.MIXED].forced, trio.current_time(), rank, leases)
            return await self.exchange(lease, generation.raw, generation, request, writer, started)
        finally:
            self.release_all(leases)

    async def exchange(
        self, lease: Lease, body: bytes, generation: GenerationRequest, request: Request,
        writer: ResponseWriter, started: float,
    ) -> int:
        """One request to one worker whose answer goes to the client.

        Raises AttemptFailed (verdict recorded) when nothing reached the client yet and
        another worker may be tried; otherwise answers the client and returns the status.
        """
        worker = lease.worker
        headers = lease.trace.inject(upstream_headers(request.headers, lease.rank, self.credential(worker)))
        idle_s = self.timeouts.stream_idle_s
        try:
            async with open_upstream_response(self.pool, worker.url, generation.path, headers, body, self.timeouts) as response:
                lease.trace.answered(response.status)
                if generation.stream and response.status == 200:
                    first = await first_stream_chunk(response, worker.url, idle_s)
                    lease.judge(Outcome.SUCCESS)
                    await lease.commit()
                    await writer.start(200, [*STREAM_HEADERS, (b"x-router-worker", worker.id.encode())])
                    self.metrics.observe_ttfb(generation.route, trio.current_time() - started)
                    await relay_stream(
                        response, first, writer, worker.url, idle_s, STREAM_ERROR_EVENTS[generation.spec.dialect]
                    )
                    return 200
                answer = await read_answer(response, worker.url, idle_s)
            # The upstream connection is back in the pool before a slow client is written to.
            judge_answer(answer, worker.url, expect_json=not generation.stream)
        except AttemptFailed as failure:
            lease.judge(Outcome.FAULT if failure.fault else Outcome.NEUTRAL)
            failure.worker_id = worker.id
            raise
        lease.judge(Outcome.SUCCESS if answer.status < 400 else Outcome.NEUTRAL)
        await lease.commit()
        self.metrics.observe_ttfb(generation.route, trio.current_time() - started)
        await writer.respond(answer.status, client_headers(answer.headers, worker.id), answer.body)
        return answer.status

    def _note_failure(self, failure: AttemptFailed, attempts: AttemptLog) -> None:
        worker_id = failure.worker_id or "?"
        attempts.reasons.append(f"{worker_id}: {failure.detail}")
        if failure.answer is not None:
            attempts.last_answer = (failure.answer, worker_id)
        log.warning(
            "attempt on %s failed (%s): %s [request %s]", worker_id, failure.reason, failure.detail, current_request_id()
        )

    async def _give_up(self, generation: GenerationRequest, writer: ResponseWriter, attempts: AttemptLog) -> int:
        if attempts.last_answer is not None:
            answer, worker_id = attempts.last_answer
            await writer.respond(answer.status, client_headers(answer.headers, worker_id), answer.body)
            return answer.status
        tried = "; ".join(attempts.reasons) or "no worker could be tried"
        raise WorkerUnreachable(f"no worker answered for model '{generation.model}': {tried}")

"""The attempt loop: plan, pick, dispatch, and fail over to another worker.

One request = one call of `GenerationService.handle`, inside the nursery the server gave
the request. Each attempt picks a worker the request has not tried, takes the worker's
breaker permit at the moment of dispatch, and records exactly one verdict for it. A
pre-first-byte failure goes back to planning; after the first byte nothing is retried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from router.breaker import Outcome, Permit
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
from router.errors import RouterError, RouterOverloaded, WorkerUnreachable
from router.generation import GENERATION_ROUTES, GenerationRequest, parse_generation_request
from router.http.messages import ClientDisconnected, Request, ResponseWriter
from router.http.pool import UpstreamPool
from router.metrics import RouterMetrics
from router.pd import PDDispatcher
from router.selection import AllOpenMode, PolicyKey, make_policy, pick_excluding, routing_key
from router.workers import Fleet, Role, Worker

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
    """Serves the generation routes: resolve, select, dispatch, fail over."""

    def __init__(self, settings: Settings, fleet: Fleet, pool: UpstreamPool, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.fleet = fleet
        self.pool = pool
        self.metrics = metrics
        self.policies = {
            Role.MIXED: make_policy(settings.policy),
            Role.PREFILL: make_policy(settings.prefill_policy),
            Role.DECODE: make_policy(settings.decode_policy),
        }
        self.all_open = AllOpenMode(settings.breaker_all_open)
        self.timeouts = Timeouts(
            connect_s=settings.connect_timeout_s,
            first_byte_s=settings.first_byte_timeout_s,
            stream_idle_s=settings.stream_idle_timeout_s,
        )
        self.pd = PDDispatcher(self)

    async def handle(self, request: Request, writer: ResponseWriter) -> None:
        """Answer one generation request.

        Cancellation (client gone, shutdown): every upstream connection of the request is
        closed, every breaker permit is released without a verdict, in-flight counts drop.
        """
        started = trio.current_time()
        route = GENERATION_ROUTES[request.path]
        model_label = "-"
        status = 500
        try:
            generation = parse_generation_request(request.path, request.body, self.fleet.models())
            if self.fleet.for_model(generation.model):
                model_label = generation.model
            status = await self._serve(generation, request, writer, started)
        except RouterError as error:
            status = error.status
            if isinstance(error, RouterOverloaded):
                self.metrics.count_local_error(error.kind)
            await writer.respond(error.status, JSON_HEADERS + error.headers(), error.body())
        except ClientDisconnected:
            status = CLIENT_LEFT
        finally:
            if request.client_gone:
                status = CLIENT_LEFT
            self.metrics.count_request(model_label, route, status)
            self.metrics.observe_duration(route, trio.current_time() - started)

    async def _serve(self, generation: GenerationRequest, request: Request, writer: ResponseWriter, started: float) -> int:
        attempts = AttemptLog()
        session = request.header(b"x-session-id")
        key_bytes = routing_key(session, generation.body)
        retry_reason: str | None = None
        for attempt in range(self.settings.max_attempts):
            now = trio.current_time()
            try:
                plan = plan_request(
                    generation.model, self.fleet.for_model(generation.model), now,
                    self.all_open, self.settings.retry_after_s,
                )
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
            if attempt == 0:
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

    def take(self, worker: Worker, forced: bool, now: float) -> Lease:
        """Take `worker` for one attempt: its breaker permit now, at dispatch, and a DP rank.

        The permit is acquired here and not when candidates are listed, so the half-open
        probe slot is only ever held by a request that is really sent to that worker.
        """
        permit: Permit | None = None
        if worker.breaker is not None:
            permit = worker.breaker.acquire(now, force=forced)
            if permit is None:
                # Only reachable if selection and dispatch disagree; dispatch forced rather
                # than drop a request the plan admitted.
                permit = worker.breaker.acquire(now, force=True)
            if permit is not None and permit.probe:
                log.info("probing %s: its breaker cooldown is over", worker.id)
        rank = self.pd.ranks.choose(worker)
        worker.begin(rank)
        return Lease(worker, permit, rank)

    def release(self, lease: Lease) -> None:
        lease.judge(Outcome.NEUTRAL)
        lease.worker.end(lease.rank)

    def pick(self, plan: Plan, role: Role, model: str, key_bytes: bytes | None, attempts: AttemptLog) -> Worker | None:
        pool = plan.legs[role]
        return pick_excluding(
            self.policies[role], PolicyKey(model, role, key_bytes), pool.candidates, attempts.tried[role]
        )

    async def _attempt_mixed(
        self, plan: Plan, generation: GenerationRequest, request: Request, writer: ResponseWriter,
        key_bytes: bytes | None, attempts: AttemptLog, started: float,
    ) -> int | None:
        worker = self.pick(plan, Role.MIXED, generation.model, key_bytes, attempts)
        if worker is None:
            return None
        attempts.tried[Role.MIXED].add(worker.id)
        lease = self.take(worker, plan.legs[Role.MIXED].forced, trio.current_time())
        try:
            return await self.exchange(lease, generation.raw, generation, request, writer, started)
        finally:
            self.release(lease)

    async def exchange(
        self, lease: Lease, body: bytes, generation: GenerationRequest, request: Request,
        writer: ResponseWriter, started: float,
    ) -> int:
        """One request to one worker whose answer goes to the client.

        Raises AttemptFailed (verdict recorded) when nothing reached the client yet and
        another worker may be tried; otherwise answers the client and returns the status.
        """
        worker = lease.worker
        headers = upstream_headers(request.headers, lease.rank)
        idle_s = self.timeouts.stream_idle_s
        try:
            async with open_upstream_response(self.pool, worker.url, generation.path, headers, body, self.timeouts) as response:
                if generation.stream and response.status == 200:
                    first = await first_stream_chunk(response, worker.url, idle_s)
                    lease.judge(Outcome.SUCCESS)
                    await lease.commit()
                    await writer.start(200, [*STREAM_HEADERS, (b"x-router-worker", worker.id.encode())])
                    self.metrics.observe_ttfb(generation.route, trio.current_time() - started)
                    await relay_stream(response, first, writer, worker.url, idle_s)
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
        log.warning("attempt on %s failed (%s): %s", worker_id, failure.reason, failure.detail)

    async def _give_up(self, generation: GenerationRequest, writer: ResponseWriter, attempts: AttemptLog) -> int:
        if attempts.last_answer is not None:
            answer, worker_id = attempts.last_answer
            await writer.respond(answer.status, client_headers(answer.headers, worker_id), answer.body)
            return answer.status
        tried = "; ".join(attempts.reasons) or "no worker could be tried"
        raise WorkerUnreachable(f"no worker answered for model '{generation.model}': {tried}")

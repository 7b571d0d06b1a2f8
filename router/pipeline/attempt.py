"""One attempt at one worker, and everything it owns.

A `Lease` is one worker taken for one attempt: its breaker permit (taken at dispatch),
its DP rank, its in-flight count and its one verdict. `AttemptRunner` takes leases,
exchanges a request with a worker through the upstream pool, and releases every lease on
every path. A strategy (`router.pipeline.mixed`, `router.pipeline.pd`) decides which workers one attempt
takes and how their exchanges fit together; the attempt loop (`router.pipeline.service`) decides
whether another attempt follows.

The verdict is recorded in one place, `Lease.settle`; a failure leaves this module as a
`WorkerFailed` that names its worker from where it is raised. A worker's 404 for a LoRA
adapter it was thought to hold is a routing miss (`adapter_missing`): another worker is
tried, the breaker records nothing, and `on_adapter_miss` tells whoever keeps the
fleet's adapters.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Final, Protocol

import trio

from router.api.error_shapes import STREAM_ERROR_EVENTS
from router.api.errors import NotOverGrpc
from router.fleet.breaker import Outcome, Permit
from router.fleet.ranks import RankChooser
from router.fleet.records import Role
from router.fleet.registry import Fleet, Worker
from router.http import clock
from router.http.server.messages import Request, ResponseWriter
from router.http.upstream.pool import UpstreamRequests
from router.observability.metrics import RequestMetrics
from router.observability.request_id import current_request_id
from router.observability.tracing import NO_ATTEMPT_TRACE, AttemptTrace, current_trace
from router.pipeline.dispatch import (
    WORKER_HEADER,
    Answer,
    AttemptFailed,
    StreamBroken,
    Timeouts,
    adapter_missing,
    client_headers,
    first_stream_chunk,
    judge_answer,
    open_upstream_response,
    read_answer,
    relay_stream,
    upstream_headers,
)
from router.pipeline.grpc_dispatch import GrpcDispatch
from router.pipeline.grpc_request import grpc_gap
from router.pipeline.plan import Plan
from router.pipeline.resolve import GenerationRequest
from router.pipeline.resume_request import RequestResume
from router.pipeline.stall_watch import StallWatch
from router.policies.policy import Policy, PolicyKey, pick_excluding, ranked_pick

# Attempts log under the name operators already filter on (docs/failover-and-breaker.md).
log: Final = logging.getLogger("router.failover")

# What of a request's headers reaches a gRPC worker as call metadata.
GRPC_METADATA: Final = frozenset({b"authorization", b"x-request-id", b"traceparent", b"tracestate"})

STREAM_HEADERS: Final[list[tuple[bytes, bytes]]] = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]


class WorkerFailed(Exception):
    """An attempt's exchange with `worker` failed before anything reached the client.

    Wraps the `AttemptFailed` the exchange raised (its `__cause__` too); its verdict is
    already recorded and the worker already counts as tried for its role.
    """

    def __init__(self, worker: Worker, failure: AttemptFailed) -> None:
        super().__init__(f"{worker.id}: {failure.detail}")
        self.worker = worker
        self.failure = failure


class StreamCut(Exception):
    """`worker`'s stream broke after the client got its first bytes, and may go on
    elsewhere (`broken` says how; nothing was written for it). The worker already counts
    as tried for its role; the breaker records nothing (the stream's start was a success).
    """

    def __init__(self, worker: Worker, broken: StreamBroken) -> None:
        super().__init__(f"{worker.id}: {broken.message}")
        self.worker = worker
        self.broken = broken


_NONE_TRIED: Final[frozenset[str]] = frozenset()


@dataclass(slots=True, init=False)
class AttemptLog:
    """What the request's attempts have done so far: the workers tried per role, the last
    worker answer worth returning, and why each failed attempt failed."""

    tried_by_role: dict[Role, set[str]] = field(default_factory=dict)
    last_answer: tuple[Answer, str] | None = None
    reasons: list[str] = field(default_factory=list)

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        tried_by_role: dict[Role, set[str]] | None = None,
        last_answer: tuple[Answer, str] | None = None,
        reasons: list[str] | None = None,
    ) -> None:
        self.tried_by_role = {} if tried_by_role is None else tried_by_role
        self.last_answer = last_answer
        self.reasons = [] if reasons is None else reasons

    def tried(self, role: Role) -> AbstractSet[str]:
        """The ids of the workers of `role` this request has tried."""
        return self.tried_by_role.get(role, _NONE_TRIED)

    def mark_tried(self, role: Role, worker_ids: Iterable[str]) -> None:
        """Count `worker_ids` as tried for `role` (a role's set is made on its first
        failure: a healthy request never makes one)."""
        tried = self.tried_by_role.get(role)
        if tried is None:
            tried = self.tried_by_role[role] = set()
        tried.update(worker_ids)

    def untried_left(self, plan: Plan) -> bool:
        """Whether every leg of `plan` still has a candidate the request has not tried.

        Only asked before a retry, so its scan is not on the path of a healthy request.
        """
        return all(
            any(worker.id not in self.tried(role) for worker in leg.candidates)
            for role, leg in plan.legs.items()
        )

    def failed(self, failed: WorkerFailed) -> None:
        worker_id = failed.worker.id
        failure = failed.failure
        self.reasons.append(f"{worker_id}: {failure.detail}")
        if failure.answer is not None:
            self.last_answer = (failure.answer, worker_id)


@dataclass(slots=True, init=False)
class RequestContext:
    """What every attempt of one request needs, built once per request."""

    generation: GenerationRequest
    request: Request
    writer: ResponseWriter
    key_bytes: bytes | None
    started: float
    log: AttemptLog = field(default_factory=AttemptLog)
    resume: RequestResume | None = None
    """A streamed generation's resume (None: its stream is relayed as it comes)."""

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        generation: GenerationRequest,
        request: Request,
        writer: ResponseWriter,
        key_bytes: bytes | None,
        started: float,
        log: AttemptLog | None = None,
        resume: RequestResume | None = None,
    ) -> None:
        self.generation = generation
        self.request = request
        self.writer = writer
        self.key_bytes = key_bytes
        self.started = started
        self.log = AttemptLog() if log is None else log
        self.resume = resume


class Strategy(Protocol):
    """How one attempt uses the workers of a plan (mixed: one worker; PD: a pair)."""

    async def attempt(self, plan: Plan, ctx: RequestContext) -> int | None:
        """Serve the request once: the status given to the client, or None when a leg
        has no untried candidate left. Raises WorkerFailed when another attempt may follow.
        Every lease it takes is released before it returns or raises."""
        ...


@dataclass(slots=True, init=False)
class Lease:
    """One worker taken for one attempt: its breaker permit, its DP rank and its verdict."""

    worker: Worker
    permit: Permit | None
    rank: int | None
    trace: AttemptTrace = NO_ATTEMPT_TRACE
    sent_at: float | None = None
    """When it was taken (the engine share tells its readings by it)."""
    settled: bool = False
    committed: bool = False
    """Its answer has begun to go to the client: from here on nothing may cancel or retry it."""
    adapter: str | None = None
    """The LoRA adapter the attempt runs on the worker, counted in flight there."""

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        worker: Worker,
        permit: Permit | None,
        rank: int | None,
        trace: AttemptTrace = NO_ATTEMPT_TRACE,
        sent_at: float | None = None,
        settled: bool = False,
        committed: bool = False,
        adapter: str | None = None,
    ) -> None:
        self.worker = worker
        self.permit = permit
        self.rank = rank
        self.trace = trace
        self.sent_at = sent_at
        self.settled = settled
        self.committed = committed
        self.adapter = adapter

    async def commit(self) -> None:
        """Pass the point of no return, unless the attempt was cancelled meanwhile.

        A PD partner's failure cancels this attempt's scope; a task already scheduled to
        resume would otherwise only see that cancellation at its next checkpoint, which can
        be inside the client write, after the response started. Checking here first makes
        "cancelled" and "committed" exclusive.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self.committed = True

    def settle(self, failure: AttemptFailed | None = None, status: int | None = None) -> None:
        """Record the attempt's one verdict on the worker's breaker (later calls do nothing).

        A failure is a fault or neutral as it says; an answer is a success below 400 and
        neutral from 400 up (the client's error, or backpressure). A lease released
        without either records neutral, which frees a half-open probe slot.
        """
        if self.settled:
            return
        self.settled = True
        if failure is not None:
            outcome = Outcome.FAULT if failure.fault else Outcome.NEUTRAL
        elif status is not None and status < 400:
            outcome = Outcome.SUCCESS
        else:
            outcome = Outcome.NEUTRAL
        self.trace.verdict(outcome)
        breaker = self.worker.breaker
        if breaker is not None and self.permit is not None:
            breaker.record(self.permit, outcome, clock.now())


class AttemptRunner:
    """Takes and releases leases and runs their exchanges with the workers."""

    def __init__(
        self,
        fleet: Fleet,
        pool: UpstreamRequests,
        request_metrics: RequestMetrics,
        timeouts: Timeouts,
        policies: Mapping[Role, Policy],
        *,
        worker_api_key: str = "",
        on_release: Callable[[Worker], None] = lambda worker: None,
        grpc: GrpcDispatch | None = None,
        on_adapter_miss: Callable[[Worker, str], None] = lambda worker, adapter: None,
    ) -> None:
        self.fleet = fleet
        self.grpc = grpc
        """Exchanges with `grpc://` workers; None: this router has no gRPC path."""
        self.pool = pool
        self.request_metrics = request_metrics
        self.timeouts = timeouts
        # One timer for the silence of every relayed stream.
        self.stalls = StallWatch(timeouts.stream_idle_s)
        self.policies = policies
        self.ranks = RankChooser()
        self._worker_api_key = worker_api_key
        self._on_release = on_release
        self._on_adapter_miss = on_adapter_miss

    def pick(self, plan: Plan, role: Role, ctx: RequestContext) -> tuple[Worker, int | None] | None:
        """The role's policy pick among the plan's candidates the request has not tried,
        and its DP rank: the policy's own choice if it makes one, else the least-loaded
        rank (`RankChooser`; None for a worker that picks its own). None when every
        candidate was tried.

        A request the gRPC path cannot serve (`grpc_gap`) never goes to a `grpc://`
        worker: they count as tried for it, and the pick is made among the HTTP workers;
        with none, NotOverGrpc (400) names the gap."""
        picked = self._pick(plan, role, ctx)
        if picked is None or not picked[0].record.is_grpc:
            return picked
        gap = grpc_gap(ctx.generation)
        if gap is None:
            return picked
        ctx.log.mark_tried(role, [w.id for w in plan.legs[role].candidates if w.record.is_grpc])
        picked = self._pick(plan, role, ctx)
        if picked is None:
            raise NotOverGrpc(
                f"{gap} over gRPC is not supported by this router, and no HTTP worker of "
                f"model '{ctx.generation.model}' can take the request instead"
            )
        return picked

    def _pick(
        self, plan: Plan, role: Role, ctx: RequestContext
    ) -> tuple[Worker, int | None] | None:
        generation = ctx.generation
        key = PolicyKey(
            generation.model,
            role,
            ctx.key_bytes,
            generation.routing_text,
            generation.body,
            generation.route,
            generation.tokens,
            self.fleet.adapter_parent(generation.model),
        )
        ranked = ranked_pick(self.policies[role])
        if ranked is None:
            worker = pick_excluding(
                self.policies[role], key, plan.legs[role].candidates, ctx.log.tried(role)
            )
            return None if worker is None else (worker, self.ranks.choose(worker))
        tried = ctx.log.tried(role)
        candidates = plan.legs[role].candidates
        remaining = [w for w in candidates if w.id not in tried] if tried else candidates
        if not remaining:
            return None
        worker, rank = ranked(key, remaining)
        if rank is None or not worker.record.rank_multiplexed:
            return worker, self.ranks.choose(worker)
        return worker, rank

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
                log.info(
                    "probing %s: its breaker cooldown is over [request %s]",
                    worker.id,
                    current_request_id(),
                )
        lease = Lease(worker, permit, rank, current_trace().attempt(worker), now)
        worker.begin(rank, now)
        leases.append(lease)
        return lease

    def release(self, lease: Lease) -> None:
        """End the lease: a neutral verdict unless one was recorded (which frees a probe
        slot), and the in-flight counts drop, even when the verdict raises."""
        try:
            lease.settle()
        finally:
            if lease.adapter is not None:
                lease.worker.adapters.ended(lease.adapter)
            lease.worker.end(lease.rank, lease.sent_at)
            lease.trace.end()
            self.fleet.lease_ended(lease.worker)
            self._on_release(lease.worker)

    def release_all(self, leases: list[Lease]) -> None:
        """Release every lease, each even when releasing another one raised."""
        if leases:
            lease = leases.pop()
            try:
                self.release(lease)
            finally:
                self.release_all(leases)

    def _failed(self, lease: Lease, failure: AttemptFailed, ctx: RequestContext) -> WorkerFailed:
        lease.settle(failure)
        worker = lease.worker
        ctx.log.mark_tried(worker.role, (worker.id,))
        return WorkerFailed(worker, failure)

    def _hold_adapter(self, lease: Lease, model: str) -> None:
        """Count the attempt in flight on its worker's adapter, when `model` is one the
        worker holds (the adapter policies read it before the engine's own reading)."""
        adapters = lease.worker.adapters
        if lease.adapter is None and model in adapters.held:
            lease.adapter = model
            adapters.began(model)

    def _judge_adapter(self, lease: Lease, answer: Answer, model: str) -> None:
        """Raise AttemptFailed for a 404 to a request for an adapter the worker was thought
        to hold (a routing miss), after telling `on_adapter_miss`."""
        worker = lease.worker
        if answer.status == 404 and model in worker.adapters.held:
            self._on_adapter_miss(worker, model)
            raise adapter_missing(answer, worker.url, model)

    def _headers(self, lease: Lease, request: Request) -> list[tuple[bytes, bytes]]:
        key = lease.worker.record.api_key or self._worker_api_key
        credential = b"Bearer " + key.encode() if key else None
        return lease.trace.inject(upstream_headers(request.headers, lease.rank, credential))

    async def exchange(self, lease: Lease, body: bytes, ctx: RequestContext) -> int:
        """One request to one worker whose answer goes to the client.

        Raises WorkerFailed when nothing reached the client yet and another worker may be
        tried; StreamCut when a stream that may resume broke after its first bytes;
        otherwise answers the client and returns the status. A continuation
        (`ctx.resume` past its seam) adds to the stream the client already has: any
        answer but a 200 stream fails it.
        """
        worker = lease.worker
        generation = ctx.generation
        if worker.record.is_grpc:
            if ctx.resume is not None and ctx.resume.seam is not None:
                # A continuation is relayed past its seam as the rest of the client's
                # stream; the gRPC path answers from the start (docs/grpc.md, the gap).
                failure = AttemptFailed(
                    "unsupported_over_grpc",
                    f"{worker.url}: a broken stream is not continued over gRPC",
                    fault=False,
                )
                raise self._failed(lease, failure, ctx)
            return await self._exchange_grpc(lease, ctx)
        idle_s = self.timeouts.stream_idle_s
        resume = ctx.resume
        events = None
        continuing = False
        if resume is not None:
            continuing = resume.seam is not None
            body, events = resume.prepare(worker, body)
        self._hold_adapter(lease, generation.model)
        try:
            async with open_upstream_response(
                self.pool,
                worker.url,
                generation.path,
                self._headers(lease, ctx.request),
                body,
                self.timeouts,
            ) as response:
                lease.trace.answered(response.status)
                if generation.stream and response.status == 200:
                    first = await first_stream_chunk(response, worker.url, idle_s)
                    head: list[tuple[bytes, bytes]] | None = None
                    if continuing:
                        lease.settle(status=200)
                        await lease.commit()
                    else:
                        await self._begin_answer(lease, 200, ctx)
                        # Sent by the relay, with the first events in the same send.
                        head = [*STREAM_HEADERS, (b"x-router-worker", worker.id.encode())]
                    try:
                        ended = await relay_stream(
                            response,
                            first,
                            ctx.writer,
                            worker.url,
                            self.stalls,
                            STREAM_ERROR_EVENTS[generation.spec.dialect],
                            events,
                            head,
                        )
                    except StreamBroken as broken:
                        ctx.log.mark_tried(worker.role, (worker.id,))
                        raise StreamCut(worker, broken) from None
                    if ended is not None and resume is not None:
                        resume.ended_broken = True
                    return 200
                answer = await read_answer(response, worker.url, idle_s)
            # The upstream connection is back in the pool before a slow client is written to.
            judge_answer(answer, worker.url, expect_json=not generation.stream)
            self._judge_adapter(lease, answer, generation.model)
            if continuing:
                raise AttemptFailed(
                    f"status_{answer.status}",
                    f"{worker.url} answered {answer.status} to the continuation of a stream",
                    fault=False,
                    retryable=False,
                )
        except AttemptFailed as failure:
            raise self._failed(lease, failure, ctx) from failure
        await self._begin_answer(lease, answer.status, ctx)
        await ctx.writer.respond(
            answer.status, client_headers(answer.headers, worker.id), answer.body
        )
        return answer.status

    async def _exchange_grpc(self, lease: Lease, ctx: RequestContext) -> int:
        """`exchange` with a `grpc://` worker (router.pipeline.grpc_dispatch)."""
        worker = lease.worker
        generation = ctx.generation
        try:
            if self.grpc is None:
                raise AttemptFailed(
                    "no_grpc", f"{worker.url}: this router has no gRPC upstream", fault=False
                )
            metadata = [h for h in self._headers(lease, ctx.request) if h[0] in GRPC_METADATA]

            async def begin(status: int) -> None:
                await self._begin_answer(lease, status, ctx)

            return await self.grpc.exchange(
                worker.url,
                generation,
                f"{current_request_id()}-{secrets.token_hex(4)}",
                lease.rank,
                metadata,
                ctx.writer,
                begin,
                (WORKER_HEADER, worker.id.encode()),
                generation.spec.dialect,
            )
        except AttemptFailed as failure:
            raise self._failed(lease, failure, ctx) from failure

    async def _begin_answer(self, lease: Lease, status: int, ctx: RequestContext) -> None:
        lease.settle(status=status)
        await lease.commit()
        self.request_metrics.observe_ttfb(ctx.generation.route, clock.now() - ctx.started)

    async def consume(self, lease: Lease, body: bytes, ctx: RequestContext) -> None:
        """One request to one worker whose answer is read and discarded (a prefill leg).

        An answer of 400 or more fails the attempt for good (every worker would repeat
        it): WorkerFailed, not retryable. Cancellation: the upstream connection closes and
        the lease records no verdict.
        """
        worker = lease.worker
        generation = ctx.generation
        self._hold_adapter(lease, generation.model)
        try:
            async with open_upstream_response(
                self.pool,
                worker.url,
                generation.path,
                self._headers(lease, ctx.request),
                body,
                self.timeouts,
            ) as response:
                lease.trace.answered(response.status)
                answer = await read_answer(response, worker.url, self.timeouts.stream_idle_s)
            judge_answer(answer, worker.url, expect_json=not generation.stream)
            self._judge_adapter(lease, answer, generation.model)
            if answer.status >= 400:
                raise AttemptFailed(
                    f"{worker.role.value}_status_{answer.status}",
                    f"{worker.role.value} {worker.url} answered {answer.status}",
                    fault=False,
                    answer=answer,
                    retryable=False,
                )
        except AttemptFailed as failure:
            raise self._failed(lease, failure, ctx) from failure
        lease.settle(status=answer.status)

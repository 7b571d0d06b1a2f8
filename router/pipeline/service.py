"""The attempt loop: plan, pick a strategy, attempt, and fail over to another worker.

One request = one call of `GenerationService.handle`, inside the nursery the server gave
the request. Each attempt is run by the plan's strategy (`router.pipeline.mixed`, `router.pipeline.pd`),
which takes its workers through `router.pipeline.attempt` and records one verdict for each. A
pre-first-byte failure goes back to planning. After the first byte nothing is retried, but
a stream that breaks may resume: its continuation is planned and attempted the same way,
on workers not tried yet, and adds to the stream the client already has
(`router.pipeline.resume_request`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from router.api.error_shapes import STREAM_ERROR_EVENTS, error_body
from router.api.errors import (
    JSON_CONTENT_TYPE,
    ModelNotFound,
    NoAvailableWorkers,
    RouterError,
    RouterOverloaded,
    WorkerUnreachable,
)
from router.api.routes import ROUTES
from router.fleet.candidates import AllOpenMode
from router.fleet.ranks import RankChooser
from router.fleet.records import Mode, Role
from router.fleet.registry import Fleet, Worker
from router.http import clock
from router.http.direct_socket import SendStalled
from router.http.grpc import GrpcPool
from router.http.server.messages import ClientDisconnected, Request, ResponseWriter
from router.http.upstream.pool import UpstreamRequests
from router.observability.metrics import PipelineMetrics, RequestMetrics
from router.observability.request_id import current_request_id
from router.pipeline.attempt import (
    AttemptRunner,
    RequestContext,
    Strategy,
    StreamCut,
    WorkerFailed,
)
from router.pipeline.continuation import Seam
from router.pipeline.dispatch import Timeouts, client_headers
from router.pipeline.engine_tokens import EngineTokens, EngineTokenSettings
from router.pipeline.grpc_dispatch import GrpcDispatch, GrpcEngines
from router.pipeline.mixed import MixedStrategy
from router.pipeline.model_names import ModelNames, ModelNameWriter, ModelRoute
from router.pipeline.pd import PDStrategy
from router.pipeline.plan import Plan, plan_request
from router.pipeline.resolve import GenerationRequest, parse_generation_request
from router.pipeline.resume import (
    OPT_OUT_HEADER,
    Outcome,
    Refusal,
    ResumeSettings,
    continuation_body,
)
from router.pipeline.resume_request import RequestResume
from router.pipeline.wait import WorkerWait, WorkerWaitSettings
from router.policies.adapter_affinity import AdapterAffinitySettings
from router.policies.by_name import make_policy
from router.policies.cache_aware import CacheAware, CacheAwareSettings
from router.policies.consistent_hash import ConsistentHash
from router.policies.kv_aware import KvAware, KvPolicyInputs
from router.policies.policy import Policy
from router.policies.routing_keys import routing_key, routing_text
from router.policies.spread import NearTies, SpreadSettings
from router.prompts.token_sources import TokenSources
from router.prompts.tokenizer import TextTokenizer

log: Final = logging.getLogger("router.failover")

CLIENT_LEFT: Final = 499  # status recorded in metrics for a client that went away
CONTINUATION_FAILED: Final = -200
"""What `_attempts` says when a broken stream found no worker for its continuation (the
client got its 200 and then the error event)."""
# The routes whose engine request has vLLM's `priority` field (SGLang's /generate has it too).
ENGINE_PRIORITY_ROUTES: Final = frozenset({"chat", "completions", "responses", "generate"})


@dataclass(frozen=True, slots=True)
class FailoverSettings:
    """What the generation path reads: policies, timeouts, attempts and waits."""

    policy: str
    prefill_policy: str
    decode_policy: str
    cache: CacheAwareSettings
    all_open: AllOpenMode
    timeouts: Timeouts
    wait: WorkerWaitSettings
    max_attempts: int
    max_n: int
    retry_after_s: float
    model_memory_s: float
    worker_api_key: str
    kv: KvPolicyInputs | None = None
    spread: SpreadSettings = field(default_factory=SpreadSettings)
    engine_tokens: EngineTokenSettings | None = None
    """Ask the engines for token ids `kv_aware` cannot compute here; None: never."""
    token_sources: TokenSources | None = None
    resume: ResumeSettings = field(default_factory=ResumeSettings)
    """Streams that break after the first byte go on elsewhere (`--resume-limit`); the
    text after the seam is made with the model's local tokenizer (`token_sources`)."""
    engine_priority: bool = False
    """Send a request's priority class to the engine as its `priority` field (vLLM run with
    `--scheduling-policy priority`): rank 0, the highest class, is served first there too."""
    names: ModelNames = field(default_factory=ModelNames)
    """The operator's aliases and fallbacks."""
    answer_alias: bool = False
    """Write an alias, not the served model, in the answer's `model` field."""
    adapters: AdapterAffinitySettings = field(default_factory=AdapterAffinitySettings)
    """What a LoRA adapter's slots cost the load-reading policies."""


class GenerationService:
    """Serves the model-keyed routes (`router.api.routes.ROUTES`): resolve, select, dispatch,
    fail over. Non-generation routes take the same path on a mixed worker."""

    def __init__(
        self,
        settings: FailoverSettings,
        fleet: Fleet,
        pool: UpstreamRequests,
        request_metrics: RequestMetrics,
        pipeline_metrics: PipelineMetrics,
        *,
        draw: Callable[[], float] | None = None,
        on_adapter_miss: Callable[[Worker, str], None] | None = None,
        grpc: GrpcPool | None = None,
    ) -> None:
        """`draw` picks among an alias's models (numbers in [0, 1); default: a generator
        seeded by the OS). `on_adapter_miss(worker, adapter)` hears of each routing miss
        (`router.engines.adapter_lists.AdapterLists.missed`; default: the fleet alone
        forgets the adapter on that worker); `grpc` carries the exchanges with `grpc://`
        workers (None: they cannot be served)."""
        self.settings = settings
        self.names = settings.names
        self.draw = draw if draw is not None else random.Random().random
        self.fleet = fleet
        self.pool = pool
        self.request_metrics = request_metrics
        self.pipeline_metrics = pipeline_metrics
        # One generator per process: replicas draw apart (router.policies.spread).
        rng = random.Random(settings.spread.seed)
        ties = NearTies(settings.spread.margin, rng)

        def build(name: str) -> Policy:
            return make_policy(
                name,
                rng=rng,
                cache=settings.cache,
                kv=settings.kv,
                ties=ties,
                adapters=settings.adapters,
            )

        self.policies = {
            Role.MIXED: build(settings.policy),
            Role.PREFILL: build(settings.prefill_policy),
            Role.DECODE: build(settings.decode_policy),
        }
        cache_aware = {
            role: policy for role, policy in self.policies.items() if isinstance(policy, CacheAware)
        }
        self.reads_text = bool(cache_aware)
        # Only consistent_hash hashes a routing key: nobody else pays for finding it.
        self.reads_key = any(isinstance(p, ConsistentHash) for p in self.policies.values())
        # The legs whose policy predicts from token ids, and how those ids are found.
        self.kv_roles = frozenset(
            role for role, policy in self.policies.items() if isinstance(policy, KvAware)
        )
        self.engine_tokens: EngineTokens | None = None
        if settings.token_sources is not None and settings.engine_tokens is not None:
            self.engine_tokens = EngineTokens(
                settings.token_sources, pool, settings.engine_tokens, settings.worker_api_key
            )
        for policy in cache_aware.values():
            fleet.add_listener(policy)
        self.waits = WorkerWait(fleet, settings.wait)
        self.grpc_engines: GrpcEngines | None = None
        grpc_dispatch: GrpcDispatch | None = None
        if grpc is not None:
            self.grpc_engines = GrpcEngines(grpc, settings.timeouts.connect_s)
            grpc_dispatch = GrpcDispatch(grpc, self.grpc_engines, settings.timeouts)
        self.runner = AttemptRunner(
            fleet,
            pool,
            request_metrics,
            settings.timeouts,
            self.policies,
            worker_api_key=settings.worker_api_key,
            on_release=self.waits.notify,
            on_adapter_miss=on_adapter_miss
            if on_adapter_miss is not None
            else fleet.adapter_missed,
            grpc=grpc_dispatch,
        )
        self.strategies: dict[Mode, Strategy] = {
            Mode.MIXED: MixedStrategy(self.runner),
            Mode.PD: PDStrategy(self.runner, pipeline_metrics, settings.max_n),
        }

    @property
    def ranks(self) -> RankChooser:
        """The DP rank rotation both strategies share (pruned when a worker leaves)."""
        return self.runner.ranks

    async def handle(
        self,
        request: Request,
        writer: ResponseWriter,
        key: str | None = None,
        priority: int | None = None,
    ) -> None:
        """Answer one generation request (`key`: the client key's name, for metrics;
        `priority`: its class's rank, for engines that schedule by it).

        Cancellation (client gone, shutdown): every upstream connection of the request is
        closed, every breaker permit is released without a verdict, in-flight counts drop.
        """
        started = clock.now()
        spec = ROUTES[request.path]
        route = spec.label
        model_label = "-"
        status = 500
        try:
            generation = parse_generation_request(
                request.path, request.body, self.fleet.models(), self.settings.max_n
            )
            if (
                priority is not None
                and self.settings.engine_priority
                and generation.route in ENGINE_PRIORITY_ROUTES
            ):
                generation.set_members(priority=priority)
            names = None if self.names.empty else self.names.resolve(generation.model, self.draw)
            if names is not None:
                writer = self._follow(names, generation, writer)
            if self.fleet.for_model(generation.model):
                model_label = generation.model
            status = await self._serve(generation, request, writer, started, names)
        except RouterError as error:
            status = error.status
            if isinstance(error, RouterOverloaded):
                self.pipeline_metrics.count_local_error(error.kind)
            await writer.respond(
                error.status, [JSON_CONTENT_TYPE, *error.headers()], error_body(error, spec.dialect)
            )
        except ClientDisconnected as gone:
            status = CLIENT_LEFT
            if isinstance(gone.__cause__, SendStalled):
                # Not the client leaving: the router cut the answer, so the operator hears it.
                log.warning(
                    "request %s cut: %s (--client-write-timeout-s)", current_request_id(), gone
                )
        finally:
            if request.client_gone:
                status = CLIENT_LEFT
            self.request_metrics.count_request(model_label, route, status, key)
            self.request_metrics.observe_duration(route, clock.now() - started)

    def _follow(
        self, route: ModelRoute, generation: GenerationRequest, writer: ResponseWriter
    ) -> ModelNameWriter:
        """Point the request at the first model of its route, and wrap the writer that
        tells the client which model answered."""
        marked = ModelNameWriter(writer)
        served = route.models[0]
        if served != generation.model:
            generation.set_members(model=served)
            generation.model = served
            marked.mark(served)
        if route.alias is not None:
            self.pipeline_metrics.count_rewrite(route.alias, served)
            if self.settings.answer_alias:
                marked.rename(served, route.alias)
        return marked

    def _fall_back(
        self, generation: GenerationRequest, writer: ResponseWriter, route: ModelRoute, to: str
    ) -> None:
        """Plan the request for `to` from now on: its body, its answer's marks, the count."""
        came_from = generation.model
        generation.set_members(model=to)
        generation.model = to
        generation.tokens = None  # another model's tokenizer: kv_aware computes them anew
        self.pipeline_metrics.count_fallback(came_from, to)
        if isinstance(writer, ModelNameWriter):
            writer.mark(to, came_from)
            # A fallback's answer names the model that served it, whatever the setting.
            writer.rename(None, route.requested)
        # Counted, not logged at INFO: under a down fleet every request falls back.
        log.debug(
            "request %s falls back from %s to %s (no worker can take it)",
            current_request_id(),
            came_from,
            to,
        )

    async def _serve(
        self,
        generation: GenerationRequest,
        request: Request,
        writer: ResponseWriter,
        started: float,
        route: ModelRoute | None = None,
    ) -> int:
        key_bytes = (
            routing_key(request.header(b"x-session-id"), generation.body)
            if self.reads_key
            else None
        )
        if self.reads_text:
            generation.routing_text = routing_text(generation.body)
        ctx = RequestContext(generation, request, writer, key_bytes, started)
        if generation.stream and self.settings.resume.limit > 0:
            ctx.resume = RequestResume(
                self.settings.resume,
                generation,
                self._local_tokenizer,
                request.header(OPT_OUT_HEADER),
            )
        while True:
            try:
                status = await self._attempts(ctx, route)
            except StreamCut as cut:
                if await self._resume(ctx, cut):
                    continue
                return 200
            resume = ctx.resume
            if resume is not None:
                if resume.seam is not None:
                    # The continuation ran to its end (or gave up, which `_give_up` counted).
                    if status != CONTINUATION_FAILED:
                        self.pipeline_metrics.count_resume(generation.route, Outcome.RESUMED)
                    return 200
                if resume.ended_broken:
                    # Broken, relayed without capture: it ended with the error event as ever.
                    self._refused(ctx, resume.why_relayed_plain())
            return status

    async def _attempts(self, ctx: RequestContext, route: ModelRoute | None) -> int:
        """Attempt the request (or its continuation) on distinct workers until one
        answers; the status given to the client. `route`: the request's model names (its
        fallbacks), None without aliases or fallbacks."""
        generation = ctx.generation
        continuing = ctx.resume is not None and ctx.resume.seam is not None
        attempts = ctx.log
        retry_reason: str | None = None
        for attempt in range(self.settings.max_attempts):
            now = clock.now()
            try:
                if continuing:
                    # A continuation carries the tokens of the model that began the stream:
                    # it stays on that model (no fallback) and waits for no worker.
                    planned = self._plan(generation, now)
                    plan: Plan | None = planned if attempts.untried_left(planned) else None
                elif attempt == 0:
                    plan = (
                        await self.waits.plan(generation.model, partial(self._plan, generation))
                        if route is None
                        else await self._first_plan(generation, ctx.writer, route)
                    )
                else:
                    plan = self._retry_plan(ctx, route, now)
            except RouterError:
                if attempt == 0 and not continuing:
                    raise
                break  # the fleet changed under a failing request: give the last answer
            if plan is None:
                break  # no untried worker left, for the model or what it falls back to
            if retry_reason is not None:
                # Counted as another worker is about to be tried: a failure that ends the
                # request is no retry, whatever its reason.
                self.pipeline_metrics.count_retry(retry_reason)
                retry_reason = None
            if attempt == 0 and not continuing and generation.spec.generation:
                # A request counts once, under the mode it was first planned in.
                self.pipeline_metrics.count_mode(plan.mode)
                if self.engine_tokens is not None:
                    await self._resolve_tokens(generation, plan)
            try:
                delivered = await self.strategies[plan.mode].attempt(plan, ctx)
            except WorkerFailed as failed:
                attempts.failed(failed)
                failure = failed.failure
                log.warning(
                    "attempt on %s failed (%s): %s [request %s]",
                    failed.worker.id,
                    failure.reason,
                    failure.detail,
                    current_request_id(),
                )
                if not failure.retryable:
                    break
                retry_reason = failure.reason
                continue
            if delivered is None:
                break  # no untried worker left
            return delivered
        return await self._give_up(ctx)

    async def _resume(self, ctx: RequestContext, cut: StreamCut) -> bool:
        """After `cut`: True when a continuation is to be attempted (`ctx.generation` is
        now its request); False when the client's stream was ended here, with the error
        event (refused) or with the end the engine had already reached."""
        resume = ctx.resume
        assert resume is not None
        generation = resume.generation
        writer = ctx.writer
        if resume.seam is not None:
            # A continuation broke: it had started, so the resume before it went on.
            self.pipeline_metrics.count_resume(generation.route, Outcome.RESUMED)
        # Kept for the error event a later failure ends with; without its traceback, whose
        # frames hold this request's context (and with it this exception): a cycle that
        # would keep every broken stream's buffers until a full collection.
        resume.broken = cut.broken.with_traceback(None)
        decision = resume.decide(cut.worker)
        if isinstance(decision, Refusal):
            self._refused(ctx, decision)
            await writer.write(cut.broken.error_event(STREAM_ERROR_EVENTS[generation.spec.dialect]))
            await writer.finish()
            return False
        seam = decision
        budget = seam.budget_left
        capture = resume.capture
        if capture is not None and capture.finish_reason is not None and seam.resumes == 0:
            # The engine had finished; only the usage and the end were lost.
            await writer.write(seam.ending())
        elif budget is not None and budget <= 0:
            await writer.write(seam.ending("length"))
        else:
            seam.resumes += 1
            ctx.generation = self._continuation(generation, seam, cut.worker)
            log.warning(
                "stream from %s broke after %d tokens (%s): resuming elsewhere [request %s]",
                cut.worker.id,
                len(seam.generated),
                cut.broken.code,
                current_request_id(),
            )
            return True
        await writer.finish()
        self.pipeline_metrics.count_resume(generation.route, Outcome.RESUMED)
        return False

    def _continuation(
        self, generation: GenerationRequest, seam: Seam, broken: Worker
    ) -> GenerationRequest:
        body, raw = continuation_body(
            generation.route,
            generation.body,
            seam.prompt_ids,
            seam.generated,
            max_model_len=broken.record.max_model_len.get(generation.model),
        )
        return GenerationRequest(
            route=generation.route,
            path=generation.path,
            model=generation.model,
            stream=True,
            body=body,
            raw=raw,
            spec=generation.spec,
            routing_text=generation.routing_text,
            tokens=[*seam.prompt_ids, *seam.generated],
        )

    def _refused(self, ctx: RequestContext, reason: Refusal) -> None:
        route = ctx.generation.route
        self.pipeline_metrics.count_resume(route, Outcome.REFUSED)
        self.pipeline_metrics.count_resume_refusal(route, reason)
        log.warning(
            "stream of request %s broke and is not resumed: %s", current_request_id(), reason.value
        )

    def _local_tokenizer(self, model: str) -> TextTokenizer | None:
        sources = self.settings.token_sources
        return None if sources is None else sources.local(model)

    async def _resolve_tokens(self, generation: GenerationRequest, plan: Plan) -> None:
        """The token ids `kv_aware` predicts with, once, before the first pick (asking an
        engine of the leg it scores when they cannot be computed here)."""
        assert self.engine_tokens is not None
        # Not `kv_roles & plan.legs.keys()`: that is a set at run time, whatever the types
        # say, and the compiled build checks the value against them.
        for role in plan.legs:
            if role not in self.kv_roles:
                continue
            generation.tokens = await self.engine_tokens.resolve(
                generation,
                plan.legs[role].candidates,
                current_request_id().encode(),
            )
            return

    async def _first_plan(
        self, generation: GenerationRequest, writer: ResponseWriter, route: ModelRoute
    ) -> Plan:
        """The first attempt's plan: for the request's model, or the first of its fallbacks
        that can take it when the model cannot (503, never the 404 of a name the client
        sent), else the model's own wait and its truthful answer. A model whose candidates
        are all breaker-open gives way to a fallback with a closed one."""
        plan_at = partial(self._plan, generation)
        if len(route.models) == 1:
            return await self.waits.plan(generation.model, plan_at)
        model = generation.model
        now = clock.now()
        primary: Plan | None = None
        if not self.waits.has_line(model):
            try:
                primary = plan_at(now)
            except NoAvailableWorkers:
                pass
            except ModelNotFound:
                if route.alias is None:
                    # A name the client sent that nobody serves stays unknown (or is waited
                    # for, if it just left): never a fallback. An alias's target that has
                    # no worker yet (a canary not deployed) gives way like a 503.
                    return await self.waits.plan(model, plan_at)
            if primary is not None and not _forced(primary):
                return primary
        for fallback in route.models[1:]:
            if self.waits.has_line(fallback):
                continue
            try:
                plan = self._plan_model(generation, fallback, now)
            except (NoAvailableWorkers, ModelNotFound):
                continue
            if primary is not None and _forced(plan):
                continue
            self._fall_back(generation, writer, route, fallback)
            return plan
        if primary is not None:
            return primary
        return await self.waits.plan(model, plan_at)

    def _retry_plan(self, ctx: RequestContext, route: ModelRoute | None, now: float) -> Plan | None:
        """A later attempt's plan: the current model's while it has an untried worker, then
        the next fallback's that has one; None when none has."""
        generation = ctx.generation
        try:
            plan = self._plan(generation, now)
        except (NoAvailableWorkers, ModelNotFound):
            if route is None:
                raise
        else:
            if ctx.log.untried_left(plan):
                return plan
        if route is None:
            return None
        models = route.models
        for fallback in models[models.index(generation.model) + 1 :]:
            try:
                plan = self._plan_model(generation, fallback, now)
            except (NoAvailableWorkers, ModelNotFound):
                continue
            if ctx.log.untried_left(plan):
                self._fall_back(generation, ctx.writer, route, fallback)
                return plan
        return None

    def _plan(self, generation: GenerationRequest, now: float) -> Plan:
        return self._plan_model(generation, generation.model, now)

    def _plan_model(self, generation: GenerationRequest, model: str, now: float) -> Plan:
        settings = self.settings
        return plan_request(
            model,
            self.fleet.for_model(model),
            now,
            settings.all_open,
            settings.retry_after_s,
            self.fleet.last_served_at(model),
            settings.model_memory_s,
            generation.spec.generation,
        )

    async def _give_up(self, ctx: RequestContext) -> int:
        attempts = ctx.log
        resume = ctx.resume
        if resume is not None and resume.seam is not None and resume.broken is not None:
            # The client's stream is open: no worker took its continuation.
            tried = "; ".join(attempts.reasons[-3:]) or "no untried worker left"
            log.warning(
                "no worker continued the stream of request %s: %s", current_request_id(), tried
            )
            self.pipeline_metrics.count_resume(ctx.generation.route, Outcome.FAILED)
            dialect = ctx.generation.spec.dialect
            await ctx.writer.write(resume.broken.error_event(STREAM_ERROR_EVENTS[dialect]))
            await ctx.writer.finish()
            return CONTINUATION_FAILED
        if attempts.last_answer is not None:
            answer, worker_id = attempts.last_answer
            await ctx.writer.respond(
                answer.status, client_headers(answer.headers, worker_id), answer.body
            )
            return answer.status
        tried = "; ".join(attempts.reasons) or "no worker could be tried"
        raise WorkerUnreachable(f"no worker answered for model '{ctx.generation.model}': {tried}")


def _forced(plan: Plan) -> bool:
    """Whether the plan would run only on breaker-open workers taken anyway."""
    return any(leg.forced for leg in plan.legs.values())

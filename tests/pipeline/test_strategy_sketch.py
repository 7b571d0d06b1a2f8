"""A third leg, sketched: encode before prefill and decode (an E/P/D split), as a strategy
that lives in this test module only.

What it shows: a new way of using workers is a new `Strategy` built on `router.pipeline.attempt`'s
runner (take, exchange or consume, release) and installed in the loop's table; nothing
else in `router/` changes for it. The encoder's lease, verdict and tried set follow the
same rules as any leg's: released on every path, one verdict, a failure that names its
worker and sends the loop to another encoder.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import cast

import orjson
import trio
import trio.testing

from router.cli.config import Settings
from router.cli.serve import failover_settings
from router.fleet.breaker import BreakerSettings, BreakerState, make_breaker
from router.fleet.records import Mode, Role, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.http.server.messages import Request
from router.http.upstream.pool import UpstreamPool
from router.observability.metrics import RouterMetrics
from router.pipeline.attempt import AttemptRunner, Lease, RequestContext, Strategy
from router.pipeline.plan import Plan
from router.pipeline.service import GenerationService
from tests.pipeline.test_service import CHAT, MODEL, Answer, Script, ScriptedPool

ENCODE_A, ENCODE_B = "http://encode-a", "http://encode-b"
PREFILL, DECODE = "http://prefill", "http://decode"


class EncodeThenPair:
    """E/P/D: an encoder from its own pool reads the request first; then the PD pair runs.

    The encoder's answer is consumed (a real engine would hand its embeddings over the
    same way prefill hands its KV cache to decode); its lease ends before the pair starts.
    """

    def __init__(self, runner: AttemptRunner, encoders: Fleet, pair: Strategy) -> None:
        self.runner = runner
        self.encoders = encoders
        self.pair = pair

    def _pick_encoder(self, ctx: RequestContext) -> Worker | None:
        tried = ctx.log.tried(Role.MIXED)  # encoders register as plain workers
        return next((worker for worker in self.encoders.workers() if worker.id not in tried), None)

    async def attempt(self, plan: Plan, ctx: RequestContext) -> int | None:
        encoder = self._pick_encoder(ctx)
        if encoder is None:
            return None
        leases: list[Lease] = []
        try:
            lease = self.runner.take(encoder, False, trio.current_time(), None, leases)
            await self.runner.consume(lease, ctx.generation.raw, ctx)
        finally:
            self.runner.release_all(leases)
        return await self.pair.attempt(plan, ctx)


def build(scripts: dict[str, Script]) -> tuple[GenerationService, ScriptedPool, Fleet, Fleet]:
    settings = Settings.defaults(breaker_failure_threshold=1, breaker_cooldown_s=5.0)
    breaker_settings = BreakerSettings(1, 5.0, 60.0)
    fleet = Fleet(lambda worker_id: make_breaker(breaker_settings, worker_id))
    fleet.upsert(WorkerRecord(id=PREFILL, url=PREFILL, models=(MODEL,), role=Role.PREFILL))
    fleet.upsert(WorkerRecord(id=DECODE, url=DECODE, models=(MODEL,), role=Role.DECODE))
    encoders = Fleet(lambda worker_id: make_breaker(breaker_settings, worker_id))
    for url in (ENCODE_A, ENCODE_B):
        encoders.upsert(WorkerRecord(id=url, url=url, models=(MODEL,)))
    pool = ScriptedPool(scripts)
    metrics = RouterMetrics(fleet)
    service = GenerationService(
        failover_settings(settings),
        fleet,
        cast(UpstreamPool, pool),
        metrics.requests,
        metrics.pipeline,
    )
    # The whole installation: one entry of the loop's table.
    service.strategies[Mode.PD] = EncodeThenPair(
        service.runner, encoders, service.strategies[Mode.PD]
    )
    return service, pool, fleet, encoders


async def send(service: GenerationService) -> Answer:
    answer = Answer()
    await service.handle(Request("POST", "/v1/chat/completions", [], CHAT), answer)
    return answer


def every_worker(*fleets: Fleet) -> list[Worker]:
    return [worker for fleet in fleets for worker in fleet.workers()]


async def test_the_encoder_runs_before_the_pair_and_every_lease_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scripts = {url: Script(latency_s=1.0) for url in (ENCODE_A, ENCODE_B, PREFILL, DECODE)}
    service, pool, fleet, encoders = build(scripts)
    answer = await send(service)
    assert answer.status == 200
    assert orjson.loads(answer.body)["choices"][0]["message"]["content"] == "hello"
    # The encoder first (t=0), then prefill and decode together once it answered (t=1).
    assert pool.dispatched == [
        (ENCODE_A, 0.0),
        (PREFILL, 1.0),
        (DECODE, 1.0),
    ] or pool.dispatched == [
        (ENCODE_A, 0.0),
        (DECODE, 1.0),
        (PREFILL, 1.0),
    ]
    assert pool.to(ENCODE_B) == []
    for worker in every_worker(fleet, encoders):
        assert worker.inflight == 0, worker.id
        assert worker.breaker is not None
        assert worker.breaker.state(trio.current_time()) is BreakerState.CLOSED


async def test_a_refusing_encoder_is_judged_once_and_the_next_attempt_takes_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scripts = {url: Script(latency_s=1.0) for url in (ENCODE_B, PREFILL, DECODE)}
    scripts[ENCODE_A] = Script(status="refuse", latency_s=0.5)
    service, pool, fleet, encoders = build(scripts)
    answer = await send(service)
    assert answer.status == 200
    # One dispatch at the bad encoder, its one fault opened its breaker (threshold 1); the
    # pair was sent once, after the good encoder answered.
    assert pool.to(ENCODE_A) == [0.0]
    assert pool.to(ENCODE_B) == [0.5]
    assert pool.to(PREFILL) == [1.5] and pool.to(DECODE) == [1.5]
    bad = encoders.get(ENCODE_A)
    assert bad is not None and bad.breaker is not None
    assert bad.breaker.state(trio.current_time()) is BreakerState.OPEN
    assert all(worker.inflight == 0 for worker in every_worker(fleet, encoders))


async def test_a_client_that_leaves_during_the_encode_ends_the_encoder_lease_without_a_verdict(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scripts = {url: Script(latency_s=3.0) for url in (ENCODE_A, ENCODE_B, PREFILL, DECODE)}
    service, pool, fleet, encoders = build(scripts)
    with trio.move_on_after(1.0):
        await send(service)
    assert pool.dispatched == [(ENCODE_A, 0.0)]
    for worker in every_worker(fleet, encoders):
        assert worker.inflight == 0, worker.id
        assert worker.breaker is not None
        stats = worker.breaker.statistics(trio.current_time())
        assert (stats.state, stats.consecutive_faults) == (BreakerState.CLOSED, 0), worker.id


def test_the_sketch_reaches_router_only_through_the_strategy_interface() -> None:
    """The strategy class above names nothing of the loop's internals: its only router
    imports are the attempt layer, the plan and the worker (the rest of this module's
    router imports build the service around it)."""
    tree = ast.parse(Path(__file__).read_text())
    sketch = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "EncodeThenPair"
    )
    used = {node.id for node in ast.walk(sketch) if isinstance(node, ast.Name)}
    router_names = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("router")
        for alias in node.names
    }
    assert {router_names[name] for name in used if name in router_names} <= {
        "router.pipeline.attempt",
        "router.pipeline.plan",
        "router.fleet.records",
        "router.fleet.registry",
    }

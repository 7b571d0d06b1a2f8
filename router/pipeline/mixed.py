"""The mixed strategy: one attempt is one worker that prefills and decodes."""

from __future__ import annotations

from router.fleet.records import Role
from router.http import clock
from router.pipeline.attempt import AttemptRunner, Lease, RequestContext
from router.pipeline.plan import Plan


class MixedStrategy:
    """One worker per attempt, its answer relayed to the client."""

    def __init__(self, runner: AttemptRunner) -> None:
        self.runner = runner

    async def attempt(self, plan: Plan, ctx: RequestContext) -> int | None:
        runner = self.runner
        picked = runner.pick(plan, Role.MIXED, ctx)
        if picked is None:
            return None
        worker, rank = picked
        leases: list[Lease] = []
        try:
            lease = runner.take(worker, plan.legs[Role.MIXED].forced, clock.now(), rank, leases)
            return await runner.exchange(lease, ctx.generation.raw, ctx)
        finally:
            runner.release_all(leases)

"""The request pipeline, a module per stage: service (the attempt loop), resolve, plan, wait, attempt, the mixed and PD strategies, dispatch and relay."""

from router.pipeline.dispatch import Timeouts
from router.pipeline.service import FailoverSettings, GenerationService
from router.pipeline.wait import WorkerWaitCollector, WorkerWaitSettings

__all__ = [
    "FailoverSettings",
    "GenerationService",
    "Timeouts",
    "WorkerWaitCollector",
    "WorkerWaitSettings",
]

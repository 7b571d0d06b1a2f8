"""The fleet: worker records, the registry of live workers and their load, each worker's LoRA adapters, DP rank accounting, the circuit breaker, and active health checks."""

from router.fleet.adapters import AdapterActivity, SlotState, WorkerAdapters
from router.fleet.breaker import BreakerSettings, BreakerState, Outcome, Permit, make_breaker
from router.fleet.candidates import AllOpenMode, LegPool, filter_leg
from router.fleet.health import serve_health_checks
from router.fleet.ranks import RankChooser
from router.fleet.records import (
    InvalidWorkerRecord,
    Mode,
    Role,
    Status,
    WorkerRecord,
    disagg_meta,
)
from router.fleet.registry import BreakerFactory, Fleet, Worker

__all__ = [
    "AdapterActivity",
    "AllOpenMode",
    "BreakerFactory",
    "BreakerSettings",
    "BreakerState",
    "Fleet",
    "InvalidWorkerRecord",
    "LegPool",
    "Mode",
    "Outcome",
    "Permit",
    "RankChooser",
    "Role",
    "SlotState",
    "Status",
    "Worker",
    "WorkerAdapters",
    "WorkerRecord",
    "disagg_meta",
    "filter_leg",
    "make_breaker",
    "serve_health_checks",
]

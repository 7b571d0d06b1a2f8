"""Candidate filtering: which workers of one leg may take a request now, and why the others
may not.

Pure and synchronous over the router's live view of the workers: it takes `now` from the
caller, never blocks and never changes a worker. It only asks a breaker whether it would
admit a request (`available`, `retry_after`): the dispatcher acquires the permit of the
worker it actually sends to, so a candidate that is looked at but not chosen never holds a
half-open probe slot.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from router.fleet.records import Role
from router.fleet.registry import Worker

Verdict = Literal["ok", "empty", "unavailable"]


class AllOpenMode(enum.StrEnum):
    """What a leg does when every worker it could take is breaker-open."""

    # A probably-bad worker beats turning a partial outage into a total one.
    DISPATCH = "dispatch"
    REJECT = "reject"


@dataclass(slots=True, init=False)
class LegPool:
    """One leg's pool for one model, after filtering.

    `workers` is every worker of the role (any status); `candidates` may take the request
    now. The counts say why the others may not, each worker counted once under its first
    reason (draining, then unhealthy, then breaker open, then at its in-flight cap).
    `forced` means the candidates are breaker-open workers taken anyway because nothing
    else could serve.
    `retry_after_s` is what a 503 for this leg would advertise.
    """

    role: Role
    workers: list[Worker]
    candidates: list[Worker]
    draining: int = 0
    unhealthy: int = 0
    breaker_open: int = 0
    full: int = 0
    forced: bool = False
    retry_after_s: float = 1.0

    # Written out: compiled, the __init__ dataclass generates would run interpreted
    # (docs/performance.md, "fifth round").
    def __init__(
        self,
        role: Role,
        workers: list[Worker],
        candidates: list[Worker],
        draining: int = 0,
        unhealthy: int = 0,
        breaker_open: int = 0,
        full: int = 0,
        forced: bool = False,
        retry_after_s: float = 1.0,
    ) -> None:
        self.role = role
        self.workers = workers
        self.candidates = candidates
        self.draining = draining
        self.unhealthy = unhealthy
        self.breaker_open = breaker_open
        self.full = full
        self.forced = forced
        self.retry_after_s = retry_after_s

    @property
    def total(self) -> int:
        return len(self.workers)

    @property
    def verdict(self) -> Verdict:
        if self.candidates:
            return "ok"
        return "unavailable" if self.workers else "empty"


def filter_leg(
    workers: Sequence[Worker],
    role: Role,
    now: float,
    all_open: AllOpenMode,
    default_retry_after_s: float = 1.0,
) -> LegPool:
    """The workers of `role` among `workers` that may take a request at `now`.

    Draining and unhealthy workers never do. Breaker-open workers do only when every
    worker that is otherwise fit is open and `all_open` is DISPATCH (the pool is then
    `forced`). Under REJECT such a pool is unavailable, and its `retry_after_s` is the
    wait until the earliest breaker admits a probe, in whole seconds, at least 1.
    """
    members: list[Worker] = []
    candidates: list[Worker] = []
    open_only: list[Worker] = []
    draining = unhealthy = full = 0
    for worker in workers:
        if worker.role is not role:
            continue
        members.append(worker)
        if worker.draining:
            draining += 1
        elif not worker.healthy:
            unhealthy += 1
        elif worker.breaker is not None and not worker.breaker.available(now):
            open_only.append(worker)
        elif worker.full:
            # A routing decision, not a fault: the request waits for a slot in the router.
            full += 1
        else:
            candidates.append(worker)
    pool = LegPool(
        role=role,
        workers=members,
        candidates=candidates,
        draining=draining,
        unhealthy=unhealthy,
        breaker_open=len(open_only),
        full=full,
        retry_after_s=default_retry_after_s,
    )
    if candidates or not open_only or full:
        # Breaker-open workers are forced only when nothing else is fit: a worker at its
        # cap frees up soon, so the request waits for it rather than for a suspect one.
        return pool
    if all_open is AllOpenMode.DISPATCH:
        pool.candidates = open_only
        pool.forced = True
    else:
        earliest = min(
            worker.breaker.retry_after(now) for worker in open_only if worker.breaker is not None
        )
        pool.retry_after_s = float(max(1, math.ceil(earliest)))
    return pool

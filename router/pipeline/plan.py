"""Which legs a request runs on, or why it cannot run: 404 versus 503, per leg.

A model nobody registered is a 404. A model whose workers exist but cannot take the
request is a 503 that names the leg(s) in the way and why. Each leg's verdict comes from
that leg's own pool only: the classic mistake is to ask every leg "did you fail?" after
the request as a whole failed, which makes a perfectly healthy leg report itself
unavailable and turns a deployment gap into a transient-looking, endlessly retried 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.api.errors import ModelNotFound, NoAvailableWorkers
from router.fleet.candidates import AllOpenMode, LegPool, filter_leg
from router.fleet.records import Mode, Role
from router.fleet.registry import Worker


@dataclass(frozen=True, slots=True, init=False)
class Plan:
    """The legs a request runs on: {MIXED: pool}, or {PREFILL: pool, DECODE: pool}."""

    mode: Mode
    legs: dict[Role, LegPool]

    # Written out: compiled, the __init__ dataclass generates would run interpreted; the
    # compiled build makes each `object.__setattr__` a plain store (docs/performance.md,
    # "fifth round").
    def __init__(self, mode: Mode, legs: dict[Role, LegPool]) -> None:
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "legs", legs)


def plan_request(
    model: str,
    workers: Sequence[Worker],
    now: float,
    all_open: AllOpenMode,
    default_retry_after_s: float = 1.0,
    last_served_at: float | None = None,
    model_memory_s: float = 0.0,
    generation: bool = True,
) -> Plan:
    """Decide how a request for `model` is served, from that model's workers only.

    `workers` is every worker registered for `model`, of any role and status. None at
    all raises `ModelNotFound`, unless the model lost its last worker at `last_served_at`
    less than `model_memory_s` before `now`: a fleet that empties for a moment (etcd
    leases expiring, a rolling restart) is a 503 `NoAvailableWorkers` with Retry-After.
    The prefill/decode pair serves when both its pools can take the request; otherwise the mixed pool does (mixed workers beside half a PD fleet
    keep a rolling upgrade serving). A pair that would only run on breaker-open workers
    gives way to a mixed pool that has a closed one. When neither can serve, raises
    `NoAvailableWorkers` naming only the blocking leg(s), with the smallest of their
    `retry_after_s` (at least 1).

    A non-generation request (`generation=False`: embeddings, rerank, tokenize, ...) is
    served by the mixed pool only; a model served by prefill/decode workers alone is a 503
    that says so.
    """
    by_role: dict[Role, list[Worker]] = {}
    for worker in workers:
        by_role.setdefault(worker.role, []).append(worker)
    if not by_role:
        if last_served_at is not None and now - last_served_at < model_memory_s:
            raise NoAvailableWorkers(
                f"model '{model}' has no worker right now (its last one left "
                f"{now - last_served_at:.1f}s ago)",
                max(1.0, default_retry_after_s),
            )
        raise ModelNotFound(f"model '{model}' is not served by any worker")

    def pool(role: Role) -> LegPool:
        return filter_leg(by_role.get(role, ()), role, now, all_open, default_retry_after_s)

    if not generation:
        if Role.MIXED not in by_role:
            raise _pd_only(model, by_role, default_retry_after_s)
        mixed_only = pool(Role.MIXED)
        if mixed_only.verdict == "ok":
            return Plan(Mode.MIXED, {Role.MIXED: mixed_only})
        label = "mixed" if _has_pd(by_role) else ""
        phrase = _blocked_phrase(model, mixed_only, label)
        raise NoAvailableWorkers(phrase, max(1.0, mixed_only.retry_after_s))
    pair = (pool(Role.PREFILL), pool(Role.DECODE)) if _has_pd(by_role) else None
    mixed = pool(Role.MIXED) if Role.MIXED in by_role else None
    pair_ok = pair is not None and all(leg.verdict == "ok" for leg in pair)
    mixed_ok = mixed is not None and mixed.verdict == "ok"

    if pair is not None and pair_ok:
        pair_forced = pair[0].forced or pair[1].forced
        if not (pair_forced and mixed is not None and mixed_ok and not mixed.forced):
            return Plan(Mode.PD, {Role.PREFILL: pair[0], Role.DECODE: pair[1]})
    if mixed is not None and mixed_ok:
        return Plan(Mode.MIXED, {Role.MIXED: mixed})
    raise _unavailable(model, pair, mixed)


def _has_pd(by_role: dict[Role, list[Worker]]) -> bool:
    return Role.PREFILL in by_role or Role.DECODE in by_role


def _pd_only(
    model: str, by_role: dict[Role, list[Worker]], retry_after_s: float
) -> NoAvailableWorkers:
    count = sum(len(workers) for workers in by_role.values())
    return NoAvailableWorkers(
        f"model '{model}' is served only by prefill/decode workers ({_count(count, 'worker')}), "
        "and PD workers serve generation only: this route needs a mixed worker",
        max(1.0, retry_after_s),
    )


def _unavailable(
    model: str, pair: tuple[LegPool, LegPool] | None, mixed: LegPool | None
) -> NoAvailableWorkers:
    phrases: list[str] = []
    blocking: list[LegPool] = []
    if pair is not None:
        for leg, partner in (pair, pair[::-1]):
            if leg.verdict != "ok":
                blocking.append(leg)
                phrases.append(_blocked_phrase(model, leg, leg.role.value))
                if partner.verdict == "ok":
                    # The healthy partner is context, never a cause.
                    phrases.append(f"{partner.role.value} has {_count(partner.total, 'worker')}")
    if mixed is not None and mixed.verdict != "ok":
        # Only a fleet that also has PD workers needs to say which pool it means.
        label = "mixed" if pair is not None else ""
        blocking.append(mixed)
        phrases.append(_blocked_phrase(model, mixed, label))
    retry_after_s = max(1.0, min(leg.retry_after_s for leg in blocking))
    return NoAvailableWorkers("; ".join(phrases), retry_after_s)


def _blocked_phrase(model: str, leg: LegPool, label: str) -> str:
    """`decode pool for model 'm' is empty` or `all 3 decode workers ... unavailable (...)`."""
    if leg.verdict == "empty":
        return f"{label} pool for model '{model}' is empty"
    noun = f"{label} worker" if label else "worker"
    if leg.total == 1:
        subject = f"the only {noun} for model '{model}' is"
    else:
        subject = f"all {leg.total} {noun}s for model '{model}' are"
    return f"{subject} unavailable ({_reasons(leg)})"


def _reasons(leg: LegPool) -> str:
    counts = (
        (leg.draining, "draining"),
        (leg.unhealthy, "unhealthy"),
        (leg.breaker_open, "breaker open"),
        (leg.full, "at capacity"),
    )
    return ", ".join(f"{count} {reason}" for count, reason in counts if count)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"

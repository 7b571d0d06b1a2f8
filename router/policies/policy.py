"""What every policy is: a pure, synchronous pick among a leg's candidates, keyed by model and
role.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, cast

from router.fleet.records import Role
from router.fleet.registry import Worker


@dataclass(frozen=True, slots=True, init=False)
class PolicyKey:
    """What a policy keys its state and its hashing on, for one request's leg."""

    model: str
    role: Role
    routing_key: bytes | None = None
    text: str | None = None
    """The whole prompt (`router.policies.routing_keys`), given only to policies that read it."""
    body: Mapping[str, Any] | None = None
    """The parsed request body (`kv_aware` reads its token ids)."""
    route: str = ""
    """The route's label (`chat`, `messages`, ...; `router.api.routes`): `kv_aware` reads
    a Messages body as Anthropic's, not as a chat body."""
    tokens: list[int] | str | None = None
    """The request's token ids as the pipeline resolved them for `kv_aware`
    (`router.pipeline.engine_tokens`), or why there are none; None: not resolved (the
    policy computes them from `body` itself)."""
    base_model: str | None = None
    """When `model` names a LoRA adapter, the base model it applies to (whose tokenizer
    and KV-block index serve it); None for a base model."""

    # Written out: compiled, the __init__ dataclass generates would run interpreted; the
    # compiled build makes each `object.__setattr__` a plain store (docs/performance.md,
    # "fifth round").
    def __init__(
        self,
        model: str,
        role: Role,
        routing_key: bytes | None = None,
        text: str | None = None,
        body: Mapping[str, Any] | None = None,
        route: str = "",
        tokens: list[int] | str | None = None,
        base_model: str | None = None,
    ) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "routing_key", routing_key)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "base_model", base_model)

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the request names, or None for a base model."""
        return self.model if self.base_model is not None else None


class Policy(Protocol):
    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        """One of `candidates` (never empty) for the request described by `key`."""
        ...


class RankedPolicy(Policy, Protocol):
    def pick_ranked(
        self, key: PolicyKey, candidates: Sequence[Worker]
    ) -> tuple[Worker, int | None]: ...


# A policy's `pick_ranked`: its pick and, for a rank-multiplexed worker, the DP rank it
# chose (None: no preference; the pipeline then takes the least-loaded rank).
RankedPick = Callable[[PolicyKey, Sequence[Worker]], tuple[Worker, int | None]]

_StateKey = tuple[str, Role]

_RANKS_BY_TYPE: Final[dict[type, bool]] = {}
"""Whether a policy class has a `pick_ranked`, learnt once per class."""


def ranked_pick(policy: Policy) -> RankedPick | None:
    """The policy's `pick_ranked` (kv_aware: the pick and the DP rank holding the prompt's
    blocks), None when it has none.

    Known per class, not asked with `getattr(policy, "pick_ranked", None)` per request: for
    a policy without one, that makes and drops an AttributeError each time
    (docs/performance.md, "fifth round")."""
    kind = type(policy)
    ranked = _RANKS_BY_TYPE.get(kind)
    if ranked is None:
        ranked = _RANKS_BY_TYPE[kind] = hasattr(policy, "pick_ranked")
    return cast("RankedPolicy", policy).pick_ranked if ranked else None


def pick_excluding(
    policy: Policy, key: PolicyKey, candidates: Sequence[Worker], tried: Collection[str]
) -> Worker | None:
    """The policy's pick among candidates whose id is not in `tried`; None when all were."""
    if not tried:
        return policy.pick(key, candidates) if candidates else None
    remaining = [worker for worker in candidates if worker.id not in tried]
    return policy.pick(key, remaining) if remaining else None

"""Candidate filtering and the selection policies.

Selection is pure, synchronous decision logic over the router's live view of the workers:
it takes `now` from the caller, never blocks and never changes a worker. `filter_leg`
decides which workers of one leg may take a request now, and why the others may not;
a `Policy` picks one of those candidates. Selection only asks a breaker whether it would
admit a request (`available`, `retry_after`): the dispatcher acquires the permit of the
worker it actually sends to, so a candidate that is looked at but not chosen never holds
a half-open probe slot.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from router.cache_aware import CacheAware, CacheAwareSettings
from router.routing_text import content_text
from router.worker_record import Role
from router.workers import Worker

Verdict = Literal["ok", "empty", "unavailable"]


class AllOpenMode(enum.StrEnum):
    """What a leg does when every worker it could take is breaker-open."""

    # A probably-bad worker beats turning a partial outage into a total one.
    DISPATCH = "dispatch"
    REJECT = "reject"


@dataclass(slots=True)
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


@dataclass(frozen=True, slots=True)
class PolicyKey:
    """What a policy keys its state and its hashing on, for one request's leg."""

    model: str
    role: Role
    routing_key: bytes | None = None
    text: str | None = None
    """The whole prompt (`router.routing_text`), given only to policies that read it."""


class Policy(Protocol):
    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        """One of `candidates` (never empty) for the request described by `key`."""
        ...


_StateKey = tuple[str, Role]


_COUNTER_MASK = (1 << 62) - 1


class RoundRobin:
    """Each (model, role) walks its candidates in turn."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next: dict[_StateKey, int] = {}

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        state_key = (key.model, key.role)
        turn = self._next.get(state_key, 0)
        # A plain counter, not one reduced modulo this call's list: a failover pick among
        # the one remaining worker must not reset the rotation the next request starts from.
        self._next[state_key] = (turn + 1) & _COUNTER_MASK
        return candidates[turn % len(candidates)]


class RandomChoice:
    """A uniformly random candidate."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        return candidates[self._rng.randrange(len(candidates))]


class LeastLoad:
    """The candidate with the fewest requests in flight through this router.

    The scan starts one place further on each time, so equal loads (an idle fleet, a
    burst arriving before any request finishes) spread instead of piling on the first.
    """

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start: dict[_StateKey, int] = {}

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        count = len(candidates)
        state_key = (key.model, key.role)
        start = self._start.get(state_key, 0) % count
        self._start[state_key] = (start + 1) % count
        best = candidates[start]
        for offset in range(1, count):
            worker = candidates[(start + offset) % count]
            if worker.inflight < best.inflight:
                best = worker
        return best


class PowerOfTwo:
    """Two distinct random candidates; the less loaded of them (the first on a tie)."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        count = len(candidates)
        if count == 1:
            return candidates[0]
        first = self._rng.randrange(count)
        second = self._rng.randrange(count - 1)
        if second >= first:
            second += 1
        a, b = candidates[first], candidates[second]
        return b if b.inflight < a.inflight else a


class ConsistentHash:
    """Rendezvous hashing of the request's routing key over the candidates' ids.

    Each candidate scores `blake2b(key, id)` and the highest wins, so removing a worker
    moves only the keys it held, and adding one takes keys only for itself. The hash is
    stable across processes (never Python's salted `hash()`), so every router replica
    sends a session to the same worker. Requests without a key fall back to round robin.
    """

    __slots__ = ("_fallback",)

    def __init__(self) -> None:
        self._fallback = RoundRobin()

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        if key.routing_key is None:
            return self._fallback.pick(key, candidates)
        return max(candidates, key=_RendezvousScore(key.routing_key))


class _RendezvousScore:
    __slots__ = ("_seed",)

    def __init__(self, routing_key: bytes) -> None:
        # The length prefix keeps (key, id) pairs unambiguous: b"ab" + b"c" != b"a" + b"bc".
        self._seed = hashlib.blake2b(len(routing_key).to_bytes(4, "big"), digest_size=8)
        self._seed.update(routing_key)

    def __call__(self, worker: Worker) -> tuple[int, str]:
        digest = self._seed.copy()
        digest.update(worker.id.encode())
        # The id breaks the (astronomically unlikely) tie the same way everywhere.
        return int.from_bytes(digest.digest(), "big"), worker.id


POLICY_NAMES = (
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
)


def make_policy(
    name: str, *, rng: random.Random | None = None, cache: CacheAwareSettings | None = None
) -> Policy:
    """A fresh policy (with its own state) by its configuration name."""
    chooser = rng if rng is not None else random.Random()
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(chooser)
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(chooser)
    if name == "consistent_hash":
        return ConsistentHash()
    if name == "cache_aware":
        return CacheAware(cache if cache is not None else CacheAwareSettings())
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")


def pick_excluding(
    policy: Policy, key: PolicyKey, candidates: Sequence[Worker], tried: Collection[str]
) -> Worker | None:
    """The policy's pick among candidates whose id is not in `tried`; None when all were."""
    if not tried:
        return policy.pick(key, candidates) if candidates else None
    remaining = [worker for worker in candidates if worker.id not in tried]
    return policy.pick(key, remaining) if remaining else None


_PREFIX_CHARS = 256
_PREFIX_TOKENS = 64


def routing_key(session_id: bytes | None, body: Mapping[str, Any]) -> bytes | None:
    """What `consistent_hash` hashes for a request: its session, else its prompt's start.

    The `X-Session-ID` header wins when present. Otherwise the prefix of the prompt:
    for chat, the messages up to and including the first user message (a conversation
    grows by appending, so every turn of it keeps that key); for completions, `prompt`
    (a string, or the first of a batch); for `/generate`, `text` or `input_ids`. At most
    256 characters or 64 token ids count. None when there is nothing usable.
    """
    if session_id:
        return session_id
    prefix = _prompt_prefix(body)
    return prefix.encode("utf-8", "surrogatepass") if prefix else None


def _prompt_prefix(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat_prefix(messages)
    for field in ("prompt", "text", "input_ids"):
        value = body.get(field)
        if value is not None:
            return _input_prefix(value)
    return ""


def _chat_prefix(messages: list[Any]) -> str:
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        text = content_text(message.get("content"))
        parts.append(text)
        size += len(text) + 1
        if size > _PREFIX_CHARS or message.get("role") == "user":
            break
    return "\n".join(parts)[:_PREFIX_CHARS]


def _input_prefix(value: Any) -> str:
    """A prompt as a string, a token-id list, or a batch of either (its first member)."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value[:_PREFIX_CHARS]
    if isinstance(value, list) and value:
        return _token_prefix(value)
    return ""


def _token_prefix(ids: list[Any]) -> str:
    head = ids[:_PREFIX_TOKENS]
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in head):
        return ""
    return "ids:" + ",".join(map(str, head))

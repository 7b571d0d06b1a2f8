"""The typed form of a conformance case: what `spec/**/*.yaml` means once loaded.

Everything here is plane-neutral data. The loader (`conformance.loader`) builds it from
YAML and is the only place that knows the file syntax; the runner and the plane adapters
read only these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROLES = ("mixed", "prefill", "decode")
STATUSES = ("active", "draining")
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}
POLICIES = ("round_robin", "random", "least_load", "power_of_two", "consistent_hash")
ALL_OPEN_MODES = ("dispatch", "reject")
FAIL_MODES = ("status", "reset", "hang", "garbage", "midstream")
STREAM_ENDS = ("done", "error", "truncated")
# The fake worker's live behaviour fields (`POST /debug/behaviour`) and their kinds.
BEHAVIOUR_FIELDS: Mapping[str, str] = {
    "tokens": "int",
    "ttft_ms": "number",
    "token_latency_ms": "number",
    "fail_first": "int",
    "fail_status": "int",
    "fail_mode": "fail_mode",
    "fail_after_chunks": "int",
    "healthy": "bool",
}
# A dispatch key that means "the whole fleet" rather than one worker.
ALL_WORKERS = "all"
# A status key for a request that got no HTTP status at all (refused, reset, timed out).
NO_STATUS: Literal["error"] = "error"
DEFAULT_MODEL = "m"

StatusKey = int | Literal["error"]


@dataclass(frozen=True, slots=True)
class Range:
    """An expected count: exact (`low == high`) or inclusive `[low, high]`."""

    low: int
    high: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.low <= value <= self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"[{self.low}, {self.high}]"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One fake worker of a case's fleet; `behaviour` is applied before the plane starts."""

    name: str
    model: str = DEFAULT_MODEL
    role: str = "mixed"
    dp_size: int = 1
    bootstrap_port: int | None = None
    status: str = "active"
    behaviour: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """None means "the plane's own default": a case sets only what it depends on."""

    threshold: int | None = None
    cooldown_s: float | None = None
    max_cooldown_s: float | None = None
    all_open: str | None = None


@dataclass(frozen=True, slots=True)
class HealthSettings:
    interval_s: float | None = None
    failure_threshold: int | None = None
    success_threshold: int | None = None


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Router behaviour in plane-neutral words; each adapter maps it to its own flags."""

    policy: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None
    attempts: int | None = None
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    api_key: str | None = None
    """The one client key the plane requires (`Authorization: Bearer`); None: no keys."""
    max_concurrent: int | None = None
    """Requests served at once; beyond it they queue (at most `queue_size`), then 429."""
    queue_size: int | None = None


@dataclass(frozen=True, slots=True)
class HeaderCheck:
    """One response header: `present`, `absent`, `equals` a value, or an integer >= `int_min`."""

    present: bool = True
    equals: str | None = None
    int_min: int | None = None

    def __str__(self) -> str:
        if not self.present:
            return "absent"
        if self.equals is not None:
            return f"equal to {self.equals!r}"
        if self.int_min is not None:
            return f"an integer >= {self.int_min}"
        return "present"


@dataclass(frozen=True, slots=True)
class HandoffCheck:
    """PD handoff fields as the fake workers received them during the step."""

    rooms_match: bool = False  # prefill and decode legs saw the same bootstrap rooms
    room_matches_rank: bool = False  # room % dp_size == the prefill's DP rank, on both legs


@dataclass(frozen=True, slots=True)
class Expect:
    """What must hold after a step. Every field is optional; unset fields are not checked.

    `status` counts are strict: a status that is not listed must not occur. `dispatches`
    counts generation requests each worker received during the step; `dispatches_total`
    counts them since the case began. `error_code`, `message_contains`, `headers`,
    `stream_end` and `body_json` apply to every response of the step.
    """

    status: Mapping[StatusKey, Range] | None = None
    error_code: str | None = None
    message_contains: tuple[str, ...] = ()
    headers: Mapping[str, HeaderCheck] = field(default_factory=dict)
    dispatches: Mapping[str, Range] = field(default_factory=dict)
    dispatches_total: Mapping[str, Range] = field(default_factory=dict)
    stream_end: str | None = None
    body_json: bool = False  # every answer's body is one JSON document
    handoffs: HandoffCheck | None = None

    @property
    def reads_workers(self) -> bool:
        return bool(self.dispatches or self.dispatches_total or self.handoffs)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """The requests a `send` step makes. `body` keys override the default body; a null
    value removes the key."""

    count: int = 1
    concurrency: int = 1
    model: str | None = None
    route: str = "chat"
    stream: bool = False
    body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class SendStep:
    line: int
    request: RequestSpec
    expect: Expect

    @property
    def label(self) -> str:
        return f"send (line {self.line})"


@dataclass(frozen=True, slots=True)
class PollStep:
    """Send one request at a time until `expect` holds for it, or fail after `timeout_s`."""

    line: int
    request: RequestSpec
    expect: Expect
    timeout_s: float = 10.0
    interval_s: float = 0.1

    @property
    def label(self) -> str:
        return f"poll (line {self.line})"


@dataclass(frozen=True, slots=True)
class WaitStep:
    line: int
    seconds: float

    @property
    def label(self) -> str:
        return f"wait {self.seconds:g}s (line {self.line})"


@dataclass(frozen=True, slots=True)
class SetBehaviourStep:
    line: int
    workers: tuple[str, ...]
    behaviour: Mapping[str, Any]

    @property
    def label(self) -> str:
        return f"set_behaviour {','.join(self.workers)} (line {self.line})"


Step = SendStep | PollStep | WaitStep | SetBehaviourStep


@dataclass(frozen=True, slots=True)
class Case:
    """One conformance case. `id` is its path under the spec root without `.yaml`."""

    id: str
    path: Path
    name: str
    description: str
    tags: tuple[str, ...]
    requires: frozenset[str]
    fleet: tuple[WorkerSpec, ...]
    settings: RouterSettings
    steps: tuple[Step, ...]

    @property
    def default_model(self) -> str:
        return self.fleet[0].model

    @property
    def is_pd(self) -> bool:
        return any(worker.role != "mixed" for worker in self.fleet)

    def worker(self, name: str) -> WorkerSpec:
        for worker in self.fleet:
            if worker.name == name:
                return worker
        raise KeyError(name)

    def capabilities_needed(self) -> frozenset[str]:
        """`requires`, plus what the fleet and settings imply on their own."""
        needed = set(self.requires)
        roles = {worker.role for worker in self.fleet}
        if roles & {"prefill", "decode"}:
            needed.add("pd")
            if "mixed" in roles:
                needed.add("pd.mixed_fleet")
        if any(worker.dp_size > 1 for worker in self.fleet):
            needed.add("dp_rank")
        if any(worker.status == "draining" for worker in self.fleet):
            needed.add("worker.status")
        if self.settings.breaker.all_open is not None:
            needed.add(f"breaker.all_open_{self.settings.breaker.all_open}")
        return frozenset(needed)

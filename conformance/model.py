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
# `not_ready`: listed but not serving (a Pod whose Ready condition is False); Kubernetes only.
STATUSES = ("active", "draining", "not_ready")
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "models": "/v1/models",
}
# The routes a step asks with GET and no body (the others POST a body).
GET_ROUTES = frozenset({"models"})
# How an error is written down: OpenAI's `{"error": {...}}` or Anthropic's
# `{"type": "error", "error": {"type", "message"}}` (bodies and a stream's error event).
ERROR_SHAPES = ("openai", "anthropic")
POLICIES = (
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
    "kv_aware",
)
ALL_OPEN_MODES = ("dispatch", "reject")
FAIL_MODES = ("status", "reset", "hang", "garbage", "midstream")
STREAM_ENDS = ("done", "error", "truncated")
# Where a case with `discovery` publishes its fleet; the plane must follow it there.
DISCOVERY_BACKENDS = ("etcd", "kubernetes")
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
    "external_load": "int",
    "lora_adapters": "names",
}
# A dispatch key that means "the whole fleet" rather than one worker.
ALL_WORKERS = "all"
# A dispatch key for whichever worker received the most (names no worker: a case cannot
# know in advance which worker a cache-following policy settles on).
BUSIEST_WORKER = "busiest"
# A status key for a request that got no HTTP status at all (refused, reset, timed out).
NO_STATUS: Literal["error"] = "error"
DEFAULT_MODEL = "m"
# What a case's workers can be: `router fake-worker` processes (scripted behaviour, debug
# counters) speaking HTTP (`fake`) or gRPC (`grpc`), or real vLLM engines (the CPU build of
# `make engine-env`, real faults only) serving their HTTP API (`vllm`) or their gRPC
# service (`vllm-grpc`).
FLEET_KINDS = ("fake", "vllm", "grpc", "vllm-grpc")
# Fleets of real engines: started once per run and lent to one case at a time.
ENGINE_FLEETS = frozenset({"vllm", "vllm-grpc"})
# Fleets whose workers speak gRPC (`grpc://` URLs): a plane routes to them only through a
# gRPC path of its own (the `upstream.grpc` capability), tokenizing prompts itself.
GRPC_FLEETS = frozenset({"grpc", "vllm-grpc"})
# The routes a gRPC worker serves through a plane: generation only (no `Embed` on the fake).
GRPC_ROUTES = ("chat", "completions", "generate", "responses", "messages")
# What a `fault` step does to a worker's process: SIGKILL its group (unreachable),
# SIGSTOP / SIGCONT it (a hang with its sockets open, and its end), or start it again on
# the same port (after a kill, or killing it first).
FAULT_ACTIONS = ("kill", "stop", "resume", "restart")

StatusKey = int | Literal["error"]


def fleet_capabilities(fleet: str) -> frozenset[str]:
    """What a plane needs to run any case on a fleet of this kind, beyond the case's own."""
    return frozenset({"upstream.grpc"}) if fleet in GRPC_FLEETS else frozenset()


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
    kv_events: bool = False
    """Keeps a prefix cache and publishes its KV-cache events as vLLM does (ZMQ, a replay
    socket, `/kv_event_sources`): what `kv_aware` routes by."""
    lora_adapters: tuple[str, ...] | None = None
    """LoRA adapters the engine holds, as vLLM holds them (listed in `/v1/models` with
    `parent`, 404 for any other model); a worker with this field (an empty list too) is a
    vLLM engine. None: the fake's default engine, which answers any model."""
    max_loras: int = 1
    """Adapters it runs at once (vLLM's `--max-loras`); a request for another waits."""
    engine: str = "sglang"
    """The engine the fake answers as: `vllm` streams token ids when asked and takes a
    prompt of ids (what a plane that resumes streams needs); `kv_events` and `lora_adapters` imply it."""


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
class CacheAwareSettings:
    """`cache_aware`'s knobs, by the SGLang gateway's names; None: the plane's default."""

    cache_threshold: float | None = None
    balance_abs_threshold: int | None = None
    balance_rel_threshold: float | None = None


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Router behaviour in plane-neutral words; each adapter maps it to its own flags."""

    policy: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None
    attempts: int | None = None
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    max_body_bytes: int | None = None  # the largest request body the plane accepts
    cache_aware: CacheAwareSettings = field(default_factory=CacheAwareSettings)
    api_key: str | None = None
    """The one client key the plane requires (`Authorization: Bearer`); None: no keys."""
    max_concurrent: int | None = None
    """Requests served at once; beyond it they queue (at most `queue_size`), then 429."""
    queue_size: int | None = None
    resume_limit: int | None = None
    """Times a stream whose worker broke after the first byte goes on on another worker;
    None: the plane's own default."""
    aliases: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Public model names, each for served models with weights."""
    fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Models a model gives way to when it has no worker that can take a request."""
    priority_classes: tuple[str, ...] = ()
    """Priority classes of the admission queue, highest first (a request's `priority`)."""
    default_priority: str | None = None
    """The class of a request that names none (required with `priority_classes`)."""


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
    counts model requests (any route) each worker received during the step; `dispatches_total`
    counts them since the case began. `error_code`, `message_contains`, `headers`,
    `stream_end` and `body_json` apply to every response of the step.
    """

    status: Mapping[StatusKey, Range] | None = None
    # Every answer's `error.code` is this one, or one of these (a list in the case file).
    error_code: str | tuple[str, ...] | None = None
    message_contains: tuple[str, ...] = ()
    headers: Mapping[str, HeaderCheck] = field(default_factory=dict)
    dispatches: Mapping[str, Range] = field(default_factory=dict)
    dispatches_total: Mapping[str, Range] = field(default_factory=dict)
    stream_end: str | None = None
    error_shape: str | None = None  # every error answer, and every stream's error event, has it
    body_json: bool = False  # every answer's body is one JSON document
    handoffs: HandoffCheck | None = None
    lists_models: Mapping[str, str | None] = field(default_factory=dict)
    """Every answer is a model list naming each of these ids, with this `parent` (None:
    none, or null)."""
    stream_text: str | None = None
    """Every stream's text (chat `delta.content`, completions `text`, joined) is exactly this."""
    stream_usage: Mapping[str, int] | None = None
    """Every stream has exactly one usage event, with these counts."""
    stream_ids: int | None = None
    """Every stream's events carry this many distinct `id`s (1: one answer, however made)."""

    @property
    def reads_workers(self) -> bool:
        return bool(self.dispatches or self.dispatches_total or self.handoffs)


@dataclass(frozen=True, slots=True)
class RawBody:
    """A body sent as bytes, not built from the route's default: exactly one of `text`
    (sent as UTF-8), `nested` (the default body plus a field nested that many lists deep)
    or `size` (the default body padded to that many bytes, still valid JSON)."""

    text: str | None = None
    nested: int | None = None
    size: int | None = None
    content_type: str = "application/json"


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
    raw: RawBody | None = None
    # Started and left running under this name; an `await` step collects the answers.
    background: str | None = None
    # Sent to this fake worker itself, past the plane, as another router's request would
    # be: what the worker's cache then holds, the plane never saw.
    worker: str | None = None
    # The priority class the request claims (one of `settings.priority_classes`); the plane
    # adapter says how (`Plane.request_headers`).
    priority: str | None = None


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


@dataclass(frozen=True, slots=True)
class AwaitStep:
    """Wait for the requests a `send` with `background: name` started, and check them."""

    line: int
    name: str
    expect: Expect

    @property
    def label(self) -> str:
        return f"await {self.name} (line {self.line})"


@dataclass(frozen=True, slots=True)
class FleetChangeStep:
    """A change of the fleet as discovery shows it: `set_status` (a worker's own record
    now says `status`), `remove` (its record is gone) or `add` (its record is back)."""

    line: int
    action: Literal["set_status", "remove", "add"]
    workers: tuple[str, ...]
    status: str | None = None  # set_status only

    @property
    def label(self) -> str:
        what = f" {self.status}" if self.status else ""
        return f"{self.action} {','.join(self.workers)}{what} (line {self.line})"


@dataclass(frozen=True, slots=True)
class FaultStep:
    """A real fault of the workers' processes (`FAULT_ACTIONS`), on any fleet kind."""

    line: int
    action: str  # one of FAULT_ACTIONS
    workers: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"fault {self.action} {','.join(self.workers)} (line {self.line})"


@dataclass(frozen=True, slots=True)
class StreamingStep:
    """Wait until every request of the background send `name` has received the first
    bytes of its answer (its worker is generating), or fail after `timeout_s`."""

    line: int
    name: str
    timeout_s: float = 30.0

    @property
    def label(self) -> str:
        return f"streaming {self.name} (line {self.line})"


Step = (
    SendStep
    | PollStep
    | WaitStep
    | SetBehaviourStep
    | AwaitStep
    | FleetChangeStep
    | FaultStep
    | StreamingStep
)


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
    discovery: str | None = None  # a backend of DISCOVERY_BACKENDS, or None: a static fleet
    fleets: frozenset[str] = frozenset({"fake"})  # the FLEET_KINDS it can run on

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
        # A terminating Pod is Kubernetes' own DRAINING: `discovery.kubernetes` covers it.
        if self.discovery != "kubernetes" and (
            any(worker.status == "draining" for worker in self.fleet)
            or any(
                isinstance(step, FleetChangeStep) and step.status == "draining"
                for step in self.steps
            )
        ):
            needed.add("worker.status")
        if self.settings.breaker.all_open is not None:
            needed.add(f"breaker.all_open_{self.settings.breaker.all_open}")
        s = self.settings
        for policy in (s.policy, s.prefill_policy, s.decode_policy):
            if policy is not None:
                needed.add(f"policy.{policy}")
        if s.health != HealthSettings():
            needed.add("health.active")
        if any(
            isinstance(step, SendStep) and step.expect.handoffs is not None for step in self.steps
        ):
            # The handoff checks read SGLang's bootstrap fields as the fake workers got them.
            needed.add("pd.bootstrap")
        if self.discovery is not None:
            needed.add(f"discovery.{self.discovery}")
        if s.api_key is not None:
            needed.add("auth.client_key")
        if s.max_concurrent is not None or s.queue_size is not None:
            needed.add("admission.queue")
        if s.max_body_bytes is not None:
            needed.add("limits.body_size")
        if s.resume_limit is not None and s.resume_limit > 0:
            needed.add("stream.resume")
        if s.aliases:
            needed.add("model.alias")
            if any(len(targets) > 1 for targets in s.aliases.values()):
                needed.add("model.alias_weights")
        if s.fallbacks:
            needed.add("model.fallback")
        if s.priority_classes:
            needed.add("admission.priority")
        for step in self.steps:
            route = step.request.route if isinstance(step, SendStep | PollStep) else "chat"
            if route != "chat" and route not in GET_ROUTES:
                needed.add(f"route.{route}")
        if any(worker.lora_adapters for worker in self.fleet):
            needed.add("lora.adapters")
        return frozenset(needed)

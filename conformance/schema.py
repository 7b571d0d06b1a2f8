"""The case schema: what each field of a case file may hold, read from composed YAML
nodes into `conformance.model` objects, with errors naming the file, line and field.

The format is described, with a worked example, in `docs/writing-spec-cases.md`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from yaml.nodes import Node

from conformance.capabilities import CAPABILITIES
from conformance.model import (
    ALL_OPEN_MODES,
    ALL_WORKERS,
    BEHAVIOUR_FIELDS,
    BUSIEST_WORKER,
    DEFAULT_MODEL,
    DISCOVERY_BACKENDS,
    FAIL_MODES,
    POLICIES,
    ROLES,
    STATUSES,
    AwaitStep,
    BreakerSettings,
    CacheAwareSettings,
    Case,
    FleetChangeStep,
    HealthSettings,
    PollStep,
    RequestSpec,
    RouterSettings,
    SendStep,
    SetBehaviourStep,
    Step,
    WaitStep,
    WorkerSpec,
)
from conformance.nodes import NodeReader, join, line_of
from conformance.schema_requests import POLL_FIELDS, RequestReader

CASE_FIELDS = (
    "name",
    "description",
    "tags",
    "requires",
    "model",
    "discovery",
    "fleet",
    "settings",
    "steps",
)
WORKER_FIELDS = ("model", "role", "dp_size", "bootstrap_port", "status", "behaviour")
SETTINGS_FIELDS = (
    "policy",
    "prefill_policy",
    "decode_policy",
    "attempts",
    "breaker",
    "health",
    "max_body_bytes",
    "cache_aware",
    "api_key",
    "max_concurrent",
    "queue_size",
)
CACHE_AWARE_FIELDS = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
BREAKER_FIELDS = ("threshold", "cooldown_s", "max_cooldown_s", "all_open")
HEALTH_FIELDS = ("interval_s", "failure_threshold", "success_threshold")
STEP_ACTIONS = ("send", "poll", "wait", "set_behaviour", "await", "set_status", "remove", "add")
FLEET_CHANGES = ("set_status", "remove", "add")


class CaseReader:
    """Reads one case file's text into a `Case`; raises SpecError at the first problem."""

    def __init__(self, path: Path, case_id: str) -> None:
        self.path = path
        self.case_id = case_id
        self.r = NodeReader(path)
        self.requests = RequestReader(self.r)
        # Background sends started so far, by name, while the steps are read in order.
        self.background: dict[str, RequestSpec] = {}

    def read(self, text: str) -> Case:
        r = self.r
        root = r.compose(text)
        top = r.mapping(root, "", CASE_FIELDS, required=("name", "description", "fleet", "steps"))
        default_model = r.string(top["model"], "model") if "model" in top else DEFAULT_MODEL
        fleet = self.fleet(top["fleet"], default_model)
        names = {worker.name for worker in fleet}
        steps_node = top["steps"]
        step_nodes = r.sequence(steps_node, "steps")
        if not step_nodes:
            raise r.fail(steps_node, "steps", "needs at least one step")
        discovery = (
            r.choice(top["discovery"], "discovery", DISCOVERY_BACKENDS)
            if "discovery" in top
            else None
        )
        steps = tuple(self.step(node, join("steps", i), names) for i, node in enumerate(step_nodes))
        self.check_steps(steps, step_nodes, discovery)
        if discovery == "kubernetes":
            self.check_pod_lifecycle(fleet, steps, step_nodes)
        else:
            self.check_no_pod_states(top["fleet"], fleet, steps, step_nodes)
        requires: frozenset[str] = frozenset()
        if "requires" in top:
            requires = frozenset(r.strings(top["requires"], "requires"))
            for name in sorted(requires):
                if name not in CAPABILITIES:
                    raise r.fail(
                        top["requires"],
                        "requires",
                        r.unknown_word(name, CAPABILITIES, "capability"),
                    )
        return Case(
            id=self.case_id,
            path=self.path,
            name=r.string(top["name"], "name"),
            description=r.string(top["description"], "description").strip(),
            tags=r.strings(top["tags"], "tags") if "tags" in top else (),
            requires=requires,
            fleet=fleet,
            settings=self.settings(top.get("settings")),
            steps=steps,
            discovery=discovery,
        )

    def check_steps(
        self, steps: Sequence[Step], nodes: Sequence[Node], discovery: str | None
    ) -> None:
        """Background sends are awaited exactly once, after they start; fleet changes need
        a discovery backend to happen in."""
        r = self.r
        awaited: set[str] = set()
        for index, (step, node) in enumerate(zip(steps, nodes, strict=True)):
            field = join("steps", index)
            if isinstance(step, FleetChangeStep) and discovery is None:
                raise r.fail(
                    node,
                    join(field, step.action),
                    "changes the fleet through discovery: set `discovery` on the case",
                )
            if isinstance(step, AwaitStep):
                if step.name in awaited:
                    raise r.fail(node, join(field, "await"), f"{step.name!r} is awaited twice")
                awaited.add(step.name)
        never = sorted(set(self.background) - awaited)
        if never:
            raise r.fail(
                nodes[-1], "steps", f"background send(s) never awaited: {', '.join(never)}"
            )

    def check_pod_lifecycle(
        self, fleet: Sequence[WorkerSpec], steps: Sequence[Step], nodes: Sequence[Node]
    ) -> None:
        """A terminating Pod cannot turn back: once `draining`, a worker only leaves
        (`remove`, then maybe `add` as a new Pod)."""
        now: dict[str, str | None] = {worker.name: worker.status for worker in fleet}
        for index, (step, node) in enumerate(zip(steps, nodes, strict=True)):
            if not isinstance(step, FleetChangeStep):
                continue
            for name in step.workers:
                if step.action == "remove":
                    now[name] = None
                elif step.action == "add" and now[name] is not None:
                    raise self.r.fail(
                        node,
                        join(join("steps", index), "add"),
                        f"pod {name} is still there; remove it first",
                    )
                elif step.action == "set_status" and now[name] in ("draining", None):
                    why = "is terminating, which cannot be undone" if now[name] else "is not there"
                    raise self.r.fail(
                        node, join(join("steps", index), "set_status"), f"pod {name} {why}"
                    )
                else:
                    now[name] = step.status or "active"

    def check_no_pod_states(
        self,
        fleet_node: Node,
        fleet: Sequence[WorkerSpec],
        steps: Sequence[Step],
        nodes: Sequence[Node],
    ) -> None:
        """`not_ready` is a Pod's state; no other fleet has it."""
        nodes_by_name = {name: value for name, _, value in self.r.items(fleet_node, "fleet")}
        for worker in fleet:
            if worker.status == "not_ready":
                field = join(join("fleet", worker.name), "status")
                raise self.r.fail(
                    nodes_by_name[worker.name], field, "not_ready needs `discovery: kubernetes`"
                )
        for index, (step, node) in enumerate(zip(steps, nodes, strict=True)):
            if isinstance(step, FleetChangeStep) and step.status == "not_ready":
                raise self.r.fail(
                    node,
                    join(join("steps", index), "set_status"),
                    "not_ready needs `discovery: kubernetes`",
                )

    # -- fleet -----------------------------------------------------------------------

    def fleet(self, node: Node, default_model: str) -> tuple[WorkerSpec, ...]:
        r = self.r
        workers = []
        for name, key_node, value in r.items(node, "fleet"):
            if name in (ALL_WORKERS, BUSIEST_WORKER):
                raise r.fail(
                    key_node, join("fleet", name), f"{name!r} is reserved in dispatch counts"
                )
            workers.append(self.worker(name, value, join("fleet", name), default_model))
        if not workers:
            raise r.fail(node, "fleet", "needs at least one worker")
        return tuple(workers)

    def worker(self, name: str, node: Node, field: str, default_model: str) -> WorkerSpec:
        r = self.r
        m = r.mapping(node, field, WORKER_FIELDS)
        role = r.choice(m["role"], join(field, "role"), ROLES) if "role" in m else "mixed"
        bootstrap_port = None
        if "bootstrap_port" in m:
            if role != "prefill":
                raise r.fail(
                    m["bootstrap_port"],
                    join(field, "bootstrap_port"),
                    "only a prefill worker has one",
                )
            bootstrap_port = r.integer(m["bootstrap_port"], join(field, "bootstrap_port"), 1, 65535)
        behaviour = (
            self.behaviour(m["behaviour"], join(field, "behaviour")) if "behaviour" in m else {}
        )
        if behaviour.get("healthy") is False:
            raise r.fail(
                m["behaviour"],
                join(field, "behaviour.healthy"),
                "a worker must start healthy (some planes never admit one that is not); "
                "make it unhealthy with a set_behaviour step",
            )
        return WorkerSpec(
            name=name,
            model=r.string(m["model"], join(field, "model")) if "model" in m else default_model,
            role=role,
            dp_size=r.integer(m["dp_size"], join(field, "dp_size"), 1, 64) if "dp_size" in m else 1,
            bootstrap_port=bootstrap_port,
            status=r.choice(m["status"], join(field, "status"), STATUSES)
            if "status" in m
            else "active",
            behaviour=behaviour,
        )

    def behaviour(self, node: Node, field: str) -> dict[str, Any]:
        r = self.r
        out: dict[str, Any] = {}
        for key, value in r.mapping(node, field, BEHAVIOUR_FIELDS).items():
            kind = BEHAVIOUR_FIELDS[key]
            where = join(field, key)
            if kind == "bool":
                out[key] = r.boolean(value, where)
            elif kind == "number":
                out[key] = r.number(value, where)
            elif kind == "fail_mode":
                out[key] = r.choice(value, where, FAIL_MODES)
            elif key == "fail_first":
                out[key] = r.integer(value, where, minimum=-1)
            elif key == "fail_status":
                out[key] = r.integer(value, where, 400, 599)
            else:
                out[key] = r.integer(value, where, minimum=0)
        return out

    # -- settings --------------------------------------------------------------------

    def settings(self, node: Node | None) -> RouterSettings:
        if node is None:
            return RouterSettings()
        r = self.r
        m = r.mapping(node, "settings", SETTINGS_FIELDS)

        def policy(key: str) -> str | None:
            return r.choice(m[key], join("settings", key), POLICIES) if key in m else None

        return RouterSettings(
            policy=policy("policy"),
            prefill_policy=policy("prefill_policy"),
            decode_policy=policy("decode_policy"),
            attempts=r.integer(m["attempts"], "settings.attempts", 1, 100)
            if "attempts" in m
            else None,
            breaker=self.breaker(m["breaker"]) if "breaker" in m else BreakerSettings(),
            health=self.health(m["health"]) if "health" in m else HealthSettings(),
            max_body_bytes=(
                r.integer(m["max_body_bytes"], "settings.max_body_bytes", 1024)
                if "max_body_bytes" in m
                else None
            ),
            api_key=r.string(m["api_key"], "settings.api_key") if "api_key" in m else None,
            max_concurrent=r.integer(m["max_concurrent"], "settings.max_concurrent", 1)
            if "max_concurrent" in m
            else None,
            queue_size=r.integer(m["queue_size"], "settings.queue_size", 0)
            if "queue_size" in m
            else None,
            cache_aware=self.cache_aware(m["cache_aware"])
            if "cache_aware" in m
            else CacheAwareSettings(),
        )

    def cache_aware(self, node: Node) -> CacheAwareSettings:
        r = self.r
        field = "settings.cache_aware"
        m = r.mapping(node, field, CACHE_AWARE_FIELDS)
        threshold = (
            r.number(m["cache_threshold"], join(field, "cache_threshold"))
            if "cache_threshold" in m
            else None
        )
        if threshold is not None and not 0 <= threshold <= 1:
            raise r.fail(
                m["cache_threshold"], join(field, "cache_threshold"), "must be between 0 and 1"
            )
        relative = (
            r.number(m["balance_rel_threshold"], join(field, "balance_rel_threshold"))
            if "balance_rel_threshold" in m
            else None
        )
        if relative is not None and relative < 1:
            raise r.fail(
                m["balance_rel_threshold"],
                join(field, "balance_rel_threshold"),
                "must be at least 1",
            )
        return CacheAwareSettings(
            cache_threshold=threshold,
            balance_abs_threshold=(
                r.integer(m["balance_abs_threshold"], join(field, "balance_abs_threshold"), 0)
                if "balance_abs_threshold" in m
                else None
            ),
            balance_rel_threshold=relative,
        )

    def breaker(self, node: Node) -> BreakerSettings:
        r = self.r
        field = "settings.breaker"
        m = r.mapping(node, field, BREAKER_FIELDS)
        cooldown = (
            r.number(m["cooldown_s"], join(field, "cooldown_s"), positive=True)
            if "cooldown_s" in m
            else None
        )
        maximum = (
            r.number(m["max_cooldown_s"], join(field, "max_cooldown_s"), positive=True)
            if "max_cooldown_s" in m
            else None
        )
        if cooldown is not None and maximum is not None and maximum < cooldown:
            raise r.fail(
                m["max_cooldown_s"],
                join(field, "max_cooldown_s"),
                f"must be >= cooldown_s ({cooldown:g})",
            )
        return BreakerSettings(
            threshold=r.integer(m["threshold"], join(field, "threshold"), 0)
            if "threshold" in m
            else None,
            cooldown_s=cooldown,
            max_cooldown_s=maximum,
            all_open=r.choice(m["all_open"], join(field, "all_open"), ALL_OPEN_MODES)
            if "all_open" in m
            else None,
        )

    def health(self, node: Node) -> HealthSettings:
        r = self.r
        field = "settings.health"
        m = r.mapping(node, field, HEALTH_FIELDS)
        return HealthSettings(
            interval_s=r.number(m["interval_s"], join(field, "interval_s"), positive=True)
            if "interval_s" in m
            else None,
            failure_threshold=(
                r.integer(m["failure_threshold"], join(field, "failure_threshold"), 1)
                if "failure_threshold" in m
                else None
            ),
            success_threshold=(
                r.integer(m["success_threshold"], join(field, "success_threshold"), 1)
                if "success_threshold" in m
                else None
            ),
        )

    # -- steps -----------------------------------------------------------------------

    def step(self, node: Node, field: str, names: set[str]) -> Step:
        r = self.r
        m = r.mapping(node, field, (*STEP_ACTIONS, "expect", "note"))
        actions = [key for key in STEP_ACTIONS if key in m]
        if len(actions) != 1:
            raise r.fail(
                node, field, f"needs exactly one of {', '.join(STEP_ACTIONS)}, got {len(actions)}"
            )
        action = actions[0]
        where = join(field, action)
        line = line_of(node)
        if action in ("wait", "set_behaviour", *FLEET_CHANGES) and "expect" in m:
            raise r.fail(m["expect"], join(field, "expect"), f"a {action} step has no expectations")
        if action == "wait":
            return WaitStep(line, r.number(m["wait"], where, positive=True))
        if action == "set_behaviour":
            return self.set_behaviour(m["set_behaviour"], where, names, line)
        if action in FLEET_CHANGES:
            return self.fleet_change(action, m[action], where, names, line)
        if action == "await":
            name = r.string(m["await"], where)
            started = self.background.get(name)
            if started is None:
                raise r.fail(m["await"], where, f"no background send {name!r} before this step")
            expect = self.requests.expect(m.get("expect"), join(field, "expect"), names, started)
            if expect.reads_workers:
                raise r.fail(
                    m["expect"],
                    join(field, "expect"),
                    "an await step can only check answers; check dispatches in a send step",
                )
            return AwaitStep(line, name, expect)
        if action == "send":
            request = self.requests.request(m["send"], where)
            expect = self.requests.expect(m.get("expect"), join(field, "expect"), names, request)
            if request.background is not None:
                if "expect" in m:
                    raise r.fail(
                        m["expect"],
                        join(field, "expect"),
                        "a background send is checked by its await step",
                    )
                if request.background in self.background:
                    raise r.fail(
                        m["send"],
                        join(where, "background"),
                        f"{request.background!r} is started twice",
                    )
                self.background[request.background] = request
            return SendStep(line, request, expect)
        poll = r.mapping(m["poll"], where, POLL_FIELDS)
        request = self.requests.request(m["poll"], where, fields=POLL_FIELDS)
        if "expect" not in m:
            raise r.fail(
                node, join(field, "expect"), "a poll step needs the expectation it waits for"
            )
        expect = self.requests.expect(m["expect"], join(field, "expect"), names, request)
        if expect.reads_workers:
            raise r.fail(
                m["expect"],
                join(field, "expect"),
                "a poll step can only check answers (status, error_code, message_contains, headers, "
                "stream_end, body_json)",
            )
        return PollStep(
            line,
            request,
            expect,
            timeout_s=r.number(poll["within_s"], join(where, "within_s"), positive=True)
            if "within_s" in poll
            else 10.0,
            interval_s=r.number(poll["interval_s"], join(where, "interval_s"), positive=True)
            if "interval_s" in poll
            else 0.1,
        )

    def set_behaviour(self, node: Node, field: str, names: set[str], line: int) -> SetBehaviourStep:
        r = self.r
        m = r.mapping(node, field, ("worker", "behaviour"), required=("worker", "behaviour"))
        workers = r.strings(m["worker"], join(field, "worker"))
        if workers == (ALL_WORKERS,):
            workers = tuple(sorted(names))
        for name in workers:
            if name not in names:
                raise r.fail(
                    m["worker"],
                    join(field, "worker"),
                    f"no worker {name!r} in the fleet ({', '.join(sorted(names))})",
                )
        behaviour = self.behaviour(m["behaviour"], join(field, "behaviour"))
        if not behaviour:
            raise r.fail(m["behaviour"], join(field, "behaviour"), "changes nothing")
        return SetBehaviourStep(line, workers, behaviour)

    def fleet_change(
        self, action: str, node: Node, field: str, names: set[str], line: int
    ) -> FleetChangeStep:
        r = self.r
        if action == "set_status":
            m = r.mapping(node, field, ("worker", "status"), required=("worker", "status"))
            workers = self.worker_names(m["worker"], join(field, "worker"), names)
            status = r.choice(m["status"], join(field, "status"), STATUSES)
            return FleetChangeStep(line, "set_status", workers, status)
        kind: Literal["remove", "add"] = "remove" if action == "remove" else "add"
        return FleetChangeStep(line, kind, self.worker_names(node, field, names))

    def worker_names(self, node: Node, field: str, names: set[str]) -> tuple[str, ...]:
        r = self.r
        workers = r.strings(node, field)
        if workers == (ALL_WORKERS,):
            return tuple(sorted(names))
        if not workers:
            raise r.fail(node, field, "names no worker")
        for name in workers:
            if name not in names:
                raise r.fail(
                    node, field, f"no worker {name!r} in the fleet ({', '.join(sorted(names))})"
                )
        return workers

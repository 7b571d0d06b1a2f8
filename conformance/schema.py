"""The case schema: what each field of a case file may hold, read from composed YAML
nodes into `conformance.model` objects, with errors naming the file, line and field.

The format is described, with a worked example, in `docs/writing-spec-cases.md`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from yaml.nodes import Node, ScalarNode, SequenceNode

from conformance.model import (
    ALL_OPEN_MODES,
    ALL_WORKERS,
    BEHAVIOUR_FIELDS,
    DEFAULT_MODEL,
    FAIL_MODES,
    NO_STATUS,
    POLICIES,
    ROLES,
    ROUTES,
    STATUSES,
    STREAM_ENDS,
    BreakerSettings,
    Case,
    Expect,
    HandoffCheck,
    HeaderCheck,
    HealthSettings,
    PollStep,
    Range,
    RequestSpec,
    RouterSettings,
    SendStep,
    SetBehaviourStep,
    StatusKey,
    Step,
    WaitStep,
    WorkerSpec,
)
from conformance.nodes import NodeReader, join, line_of

CASE_FIELDS = ("name", "description", "tags", "requires", "model", "fleet", "settings", "steps")
WORKER_FIELDS = ("model", "role", "dp_size", "bootstrap_port", "status", "behaviour")
SETTINGS_FIELDS = (
    "policy", "prefill_policy", "decode_policy", "attempts", "breaker", "health", "api_key", "max_concurrent", "queue_size",
)
BREAKER_FIELDS = ("threshold", "cooldown_s", "max_cooldown_s", "all_open")
HEALTH_FIELDS = ("interval_s", "failure_threshold", "success_threshold")
REQUEST_FIELDS = ("count", "concurrency", "model", "route", "stream", "body", "headers", "timeout_s")
POLL_FIELDS = ("model", "route", "stream", "body", "headers", "timeout_s", "within_s", "interval_s")
EXPECT_FIELDS = (
    "status", "error_code", "message_contains", "headers", "dispatches", "dispatches_total",
    "stream_end", "body_json", "handoffs",
)
STEP_ACTIONS = ("send", "poll", "wait", "set_behaviour")
# Past this a request would hold a fleet longer than any case should take.
MAX_COUNT = 1000


class CaseReader:
    """Reads one case file's text into a `Case`; raises SpecError at the first problem."""

    def __init__(self, path: Path, case_id: str) -> None:
        self.path = path
        self.case_id = case_id
        self.r = NodeReader(path)

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
        steps = tuple(self.step(node, join("steps", i), names) for i, node in enumerate(step_nodes))
        return Case(
            id=self.case_id,
            path=self.path,
            name=r.string(top["name"], "name"),
            description=r.string(top["description"], "description").strip(),
            tags=r.strings(top["tags"], "tags") if "tags" in top else (),
            requires=frozenset(r.strings(top["requires"], "requires")) if "requires" in top else frozenset(),
            fleet=fleet,
            settings=self.settings(top.get("settings")),
            steps=steps,
        )

    # -- fleet -----------------------------------------------------------------------

    def fleet(self, node: Node, default_model: str) -> tuple[WorkerSpec, ...]:
        r = self.r
        workers = []
        for name, key_node, value in r.items(node, "fleet"):
            if name == ALL_WORKERS:
                raise r.fail(key_node, join("fleet", name), f"{ALL_WORKERS!r} is reserved for the whole fleet")
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
                raise r.fail(m["bootstrap_port"], join(field, "bootstrap_port"), "only a prefill worker has one")
            bootstrap_port = r.integer(m["bootstrap_port"], join(field, "bootstrap_port"), 1, 65535)
        behaviour = self.behaviour(m["behaviour"], join(field, "behaviour")) if "behaviour" in m else {}
        if behaviour.get("healthy") is False:
            raise r.fail(
                m["behaviour"], join(field, "behaviour.healthy"),
                "a worker must start healthy (some planes never admit one that is not); "
                "make it unhealthy with a set_behaviour step",
            )
        return WorkerSpec(
            name=name,
            model=r.string(m["model"], join(field, "model")) if "model" in m else default_model,
            role=role,
            dp_size=r.integer(m["dp_size"], join(field, "dp_size"), 1, 64) if "dp_size" in m else 1,
            bootstrap_port=bootstrap_port,
            status=r.choice(m["status"], join(field, "status"), STATUSES) if "status" in m else "active",
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
            attempts=r.integer(m["attempts"], "settings.attempts", 1, 100) if "attempts" in m else None,
            breaker=self.breaker(m["breaker"]) if "breaker" in m else BreakerSettings(),
            health=self.health(m["health"]) if "health" in m else HealthSettings(),
            api_key=r.string(m["api_key"], "settings.api_key") if "api_key" in m else None,
            max_concurrent=r.integer(m["max_concurrent"], "settings.max_concurrent", 1) if "max_concurrent" in m else None,
            queue_size=r.integer(m["queue_size"], "settings.queue_size", 0) if "queue_size" in m else None,
        )

    def breaker(self, node: Node) -> BreakerSettings:
        r = self.r
        field = "settings.breaker"
        m = r.mapping(node, field, BREAKER_FIELDS)
        cooldown = r.number(m["cooldown_s"], join(field, "cooldown_s"), positive=True) if "cooldown_s" in m else None
        maximum = (
            r.number(m["max_cooldown_s"], join(field, "max_cooldown_s"), positive=True)
            if "max_cooldown_s" in m
            else None
        )
        if cooldown is not None and maximum is not None and maximum < cooldown:
            raise r.fail(m["max_cooldown_s"], join(field, "max_cooldown_s"), f"must be >= cooldown_s ({cooldown:g})")
        return BreakerSettings(
            threshold=r.integer(m["threshold"], join(field, "threshold"), 0) if "threshold" in m else None,
            cooldown_s=cooldown,
            max_cooldown_s=maximum,
            all_open=r.choice(m["all_open"], join(field, "all_open"), ALL_OPEN_MODES) if "all_open" in m else None,
        )

    def health(self, node: Node) -> HealthSettings:
        r = self.r
        field = "settings.health"
        m = r.mapping(node, field, HEALTH_FIELDS)
        return HealthSettings(
            interval_s=r.number(m["interval_s"], join(field, "interval_s"), positive=True) if "interval_s" in m else None,
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
            raise r.fail(node, field, f"needs exactly one of {', '.join(STEP_ACTIONS)}, got {len(actions)}")
        action = actions[0]
        where = join(field, action)
        line = line_of(node)
        if action in ("wait", "set_behaviour") and "expect" in m:
            raise r.fail(m["expect"], join(field, "expect"), f"a {action} step has no expectations")
        if action == "wait":
            return WaitStep(line, r.number(m["wait"], where, positive=True))
        if action == "set_behaviour":
            return self.set_behaviour(m["set_behaviour"], where, names, line)
        if action == "send":
            request = self.request(m["send"], where)
            expect = self.expect(m.get("expect"), join(field, "expect"), names, request)
            return SendStep(line, request, expect)
        poll = r.mapping(m["poll"], where, POLL_FIELDS)
        request = self.request(m["poll"], where, fields=POLL_FIELDS)
        if "expect" not in m:
            raise r.fail(node, join(field, "expect"), "a poll step needs the expectation it waits for")
        expect = self.expect(m["expect"], join(field, "expect"), names, request)
        if expect.reads_workers:
            raise r.fail(
                m["expect"], join(field, "expect"),
                "a poll step can only check answers (status, error_code, message_contains, headers, "
                "stream_end, body_json)",
            )
        return PollStep(
            line,
            request,
            expect,
            timeout_s=r.number(poll["within_s"], join(where, "within_s"), positive=True) if "within_s" in poll else 10.0,
            interval_s=r.number(poll["interval_s"], join(where, "interval_s"), positive=True) if "interval_s" in poll else 0.1,
        )

    def set_behaviour(self, node: Node, field: str, names: set[str], line: int) -> SetBehaviourStep:
        r = self.r
        m = r.mapping(node, field, ("worker", "behaviour"), required=("worker", "behaviour"))
        workers = r.strings(m["worker"], join(field, "worker"))
        if workers == (ALL_WORKERS,):
            workers = tuple(sorted(names))
        for name in workers:
            if name not in names:
                raise r.fail(m["worker"], join(field, "worker"), f"no worker {name!r} in the fleet ({', '.join(sorted(names))})")
        behaviour = self.behaviour(m["behaviour"], join(field, "behaviour"))
        if not behaviour:
            raise r.fail(m["behaviour"], join(field, "behaviour"), "changes nothing")
        return SetBehaviourStep(line, workers, behaviour)

    def request(self, node: Node, field: str, fields: Sequence[str] = REQUEST_FIELDS) -> RequestSpec:
        r = self.r
        m = r.mapping(node, field, fields)
        body: dict[str, Any] = {}
        if "body" in m:
            value = r.value(m["body"], join(field, "body"))
            if not isinstance(value, dict):
                raise r.fail(m["body"], join(field, "body"), "must be a mapping of body fields")
            body = value
        headers: dict[str, str] = {}
        for key, _, value_node in r.items(m.get("headers", _null()), join(field, "headers")):
            headers[key] = str(r.scalar(value_node, join(field, f"headers.{key}")))
        count = r.integer(m["count"], join(field, "count"), 1, MAX_COUNT) if "count" in m else 1
        concurrency = r.integer(m["concurrency"], join(field, "concurrency"), 1, MAX_COUNT) if "concurrency" in m else 1
        return RequestSpec(
            count=count,
            concurrency=concurrency,
            model=r.string(m["model"], join(field, "model")) if "model" in m else None,
            route=r.choice(m["route"], join(field, "route"), ROUTES) if "route" in m else "chat",
            stream=r.boolean(m["stream"], join(field, "stream")) if "stream" in m else False,
            body=body,
            headers=headers,
            timeout_s=r.number(m["timeout_s"], join(field, "timeout_s"), positive=True) if "timeout_s" in m else 10.0,
        )

    def expect(self, node: Node | None, field: str, names: set[str], request: RequestSpec) -> Expect:
        if node is None:
            return Expect()
        r = self.r
        m = r.mapping(node, field, EXPECT_FIELDS)
        stream_end = None
        if "stream_end" in m:
            stream_end = r.choice(m["stream_end"], join(field, "stream_end"), STREAM_ENDS)
            if not request.stream:
                raise r.fail(m["stream_end"], join(field, "stream_end"), "only a streaming request (stream: true) has one")
        return Expect(
            status=self.status(m["status"], join(field, "status"), request.count) if "status" in m else None,
            error_code=r.string(m["error_code"], join(field, "error_code")) if "error_code" in m else None,
            message_contains=r.strings(m["message_contains"], join(field, "message_contains")) if "message_contains" in m else (),
            headers=self.headers(m["headers"], join(field, "headers")) if "headers" in m else {},
            dispatches=self.counts(m["dispatches"], join(field, "dispatches"), names) if "dispatches" in m else {},
            dispatches_total=(
                self.counts(m["dispatches_total"], join(field, "dispatches_total"), names)
                if "dispatches_total" in m
                else {}
            ),
            stream_end=stream_end,
            body_json=r.boolean(m["body_json"], join(field, "body_json")) if "body_json" in m else False,
            handoffs=self.handoffs(m["handoffs"], join(field, "handoffs")) if "handoffs" in m else None,
        )

    def status(self, node: Node, field: str, count: int) -> dict[StatusKey, Range]:
        r = self.r
        if isinstance(node, ScalarNode):
            code = r.integer(node, field, 100, 599)
            return {code: Range(count, count)}
        counts: dict[StatusKey, Range] = {}
        for key, key_node, value in r.items(node, field):
            status: StatusKey
            if key == NO_STATUS:
                status = NO_STATUS
            elif key.isdigit() and 100 <= int(key) <= 599:
                status = int(key)
            else:
                raise r.fail(key_node, join(field, key), f"must be an HTTP status (100-599) or {NO_STATUS!r}")
            counts[status] = self.range(value, join(field, key))
        if sum(c.low for c in counts.values()) > count:
            raise r.fail(node, field, f"the least counts add up to more than the {count} requests sent")
        return counts

    def counts(self, node: Node, field: str, names: set[str]) -> dict[str, Range]:
        r = self.r
        out: dict[str, Range] = {}
        for key, key_node, value in r.items(node, field):
            if key != ALL_WORKERS and key not in names:
                raise r.fail(key_node, join(field, key), f"no worker {key!r} in the fleet ({', '.join(sorted(names))})")
            out[key] = self.range(value, join(field, key))
        return out

    def range(self, node: Node, field: str) -> Range:
        r = self.r
        if isinstance(node, SequenceNode):
            items = r.sequence(node, field)
            if len(items) != 2:
                raise r.fail(node, field, "a range is [min, max]")
            low = r.integer(items[0], join(field, 0), 0)
            high = r.integer(items[1], join(field, 1), 0)
            if high < low:
                raise r.fail(node, field, f"max {high} is below min {low}")
            return Range(low, high)
        value = r.scalar(node, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise r.fail(node, field, f"must be a count (integer >= 0) or [min, max], got {value!r}")
        return Range(value, value)

    def headers(self, node: Node, field: str) -> dict[str, HeaderCheck]:
        r = self.r
        out: dict[str, HeaderCheck] = {}
        for key, _, value in r.items(node, field):
            where = join(field, key)
            if isinstance(value, ScalarNode):
                word = r.choice(value, where, ("present", "absent"))
                out[key.lower()] = HeaderCheck(present=word == "present")
                continue
            m = r.mapping(value, where, ("equals", "int_min"))
            if len(m) != 1:
                raise r.fail(value, where, "needs exactly one of equals, int_min")
            if "equals" in m:
                out[key.lower()] = HeaderCheck(equals=str(r.scalar(m["equals"], join(where, "equals"))))
            else:
                out[key.lower()] = HeaderCheck(int_min=r.integer(m["int_min"], join(where, "int_min")))
        return out

    def handoffs(self, node: Node, field: str) -> HandoffCheck:
        r = self.r
        m = r.mapping(node, field, ("rooms_match", "room_matches_rank"))
        check = HandoffCheck(
            rooms_match=r.boolean(m["rooms_match"], join(field, "rooms_match")) if "rooms_match" in m else False,
            room_matches_rank=(
                r.boolean(m["room_matches_rank"], join(field, "room_matches_rank"))
                if "room_matches_rank" in m
                else False
            ),
        )
        if not (check.rooms_match or check.room_matches_rank):
            raise r.fail(node, field, "checks nothing")
        return check


def _null() -> Node:
    return ScalarNode("tag:yaml.org,2002:null", "")

"""The steps of a case, one at a time: `send`, `poll`, `wait`, `set_behaviour`, `await`,
the fleet changes (`set_status`, `remove`, `add`), the process faults (`fault`) and
`streaming` (wait for a background send's first bytes).

Part of the case schema (`conformance.schema`), which checks the steps as a sequence.
"""

from __future__ import annotations

from typing import Literal

from yaml.nodes import Node

from conformance.model import (
    ALL_WORKERS,
    FAULT_ACTIONS,
    STATUSES,
    AwaitStep,
    FaultStep,
    FleetChangeStep,
    PollStep,
    RequestSpec,
    SendStep,
    SetBehaviourStep,
    Step,
    StreamingStep,
    WaitStep,
)
from conformance.nodes import NodeReader, join, line_of
from conformance.schema_fleet import FleetReader
from conformance.schema_requests import POLL_FIELDS, RequestReader

STEP_ACTIONS = (
    "send",
    "poll",
    "wait",
    "set_behaviour",
    "await",
    "set_status",
    "remove",
    "add",
    "fault",
    "streaming",
)
FLEET_CHANGES = ("set_status", "remove", "add")
# Steps that only act: they carry no expectations.
ACTING = ("wait", "set_behaviour", "fault", "streaming", *FLEET_CHANGES)


class StepReader:
    """Reads the steps of one case file in order; raises SpecError at the first problem."""

    def __init__(self, r: NodeReader, fleet: FleetReader) -> None:
        self.r = r
        self.fleet = fleet
        self.requests = RequestReader(r)
        # Background sends started so far, by name, while the steps are read in order.
        self.background: dict[str, RequestSpec] = {}

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
        if action in ACTING and "expect" in m:
            raise r.fail(m["expect"], join(field, "expect"), f"a {action} step has no expectations")
        if action == "wait":
            return WaitStep(line, r.number(m["wait"], where, positive=True))
        if action == "fault":
            return self.fault(m["fault"], where, names, line)
        if action == "streaming":
            name = r.string(m["streaming"], where)
            started = self.background.get(name)
            if started is None:
                raise r.fail(m["streaming"], where, f"no background send {name!r} before this step")
            return StreamingStep(line, name, timeout_s=max(30.0, started.timeout_s))
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
            if request.worker is not None:
                if request.worker not in names:
                    raise r.fail(
                        m["send"],
                        join(where, "worker"),
                        f"{request.worker!r} is not a worker of the fleet",
                    )
                if request.background is not None:
                    raise r.fail(
                        m["send"],
                        join(where, "worker"),
                        "a request sent to a worker itself is not a background send",
                    )
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
        workers = self.worker_names(m["worker"], join(field, "worker"), names)
        behaviour = self.fleet.behaviour(m["behaviour"], join(field, "behaviour"))
        if not behaviour:
            raise r.fail(m["behaviour"], join(field, "behaviour"), "changes nothing")
        return SetBehaviourStep(line, workers, behaviour)

    def fault(self, node: Node, field: str, names: set[str], line: int) -> FaultStep:
        r = self.r
        m = r.mapping(node, field, ("worker", "action"), required=("worker", "action"))
        workers = self.changed_workers(m["worker"], join(field, "worker"), names)
        return FaultStep(line, r.choice(m["action"], join(field, "action"), FAULT_ACTIONS), workers)

    def fleet_change(
        self, action: str, node: Node, field: str, names: set[str], line: int
    ) -> FleetChangeStep:
        r = self.r
        if action == "set_status":
            m = r.mapping(node, field, ("worker", "status"), required=("worker", "status"))
            workers = self.changed_workers(m["worker"], join(field, "worker"), names)
            status = r.choice(m["status"], join(field, "status"), STATUSES)
            return FleetChangeStep(line, "set_status", workers, status)
        kind: Literal["remove", "add"] = "remove" if action == "remove" else "add"
        return FleetChangeStep(line, kind, self.changed_workers(node, field, names))

    def worker_names(self, node: Node, field: str, names: set[str]) -> tuple[str, ...]:
        """A name or a list of names of the fleet's workers; `all` is every one of them."""
        r = self.r
        workers = r.strings(node, field)
        if workers == (ALL_WORKERS,):
            return tuple(sorted(names))
        for name in workers:
            if name not in names:
                raise r.fail(
                    node, field, f"no worker {name!r} in the fleet ({', '.join(sorted(names))})"
                )
        return workers

    def changed_workers(self, node: Node, field: str, names: set[str]) -> tuple[str, ...]:
        """The workers a fleet change is about: `worker_names`, at least one."""
        workers = self.worker_names(node, field, names)
        if not workers:
            raise self.r.fail(node, field, "names no worker")
        return workers

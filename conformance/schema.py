"""The case schema: what each field of a case file may hold, read from composed YAML
nodes into `conformance.model` objects, with errors naming the file, line and field.

This module reads a case as a whole: its top-level fields and the rules that span its
fleet and its steps (every background send awaited once, fleet changes only under
discovery, a Pod's lifecycle). The parts have modules of their own: `schema_fleet` (the
workers), `schema_settings` (the router settings), `schema_steps` (each step) and
`schema_requests` (what a step sends and expects).

The format is described, with a worked example, in `docs/writing-spec-cases.md`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from yaml.nodes import Node

from conformance.capabilities import CAPABILITIES
from conformance.model import (
    DEFAULT_MODEL,
    DISCOVERY_BACKENDS,
    ENGINE_FLEETS,
    FLEET_KINDS,
    GRPC_FLEETS,
    GRPC_ROUTES,
    AwaitStep,
    Case,
    FleetChangeStep,
    PollStep,
    SendStep,
    SetBehaviourStep,
    Step,
    WorkerSpec,
)
from conformance.nodes import NodeReader, join
from conformance.schema_fleet import FleetReader
from conformance.schema_settings import SettingsReader
from conformance.schema_steps import StepReader

CASE_FIELDS = (
    "name",
    "description",
    "tags",
    "requires",
    "model",
    "discovery",
    "fleets",
    "fleet",
    "settings",
    "steps",
)


class CaseReader:
    """Reads one case file's text into a `Case`; raises SpecError at the first problem."""

    def __init__(self, path: Path, case_id: str) -> None:
        self.path = path
        self.case_id = case_id
        self.r = NodeReader(path)
        self.fleet_reader = FleetReader(self.r)
        self.settings_reader = SettingsReader(self.r)
        self.step_reader = StepReader(self.r, self.fleet_reader)

    def read(self, text: str) -> Case:
        r = self.r
        root = r.compose(text)
        top = r.mapping(root, "", CASE_FIELDS, required=("name", "description", "fleet", "steps"))
        default_model = r.string(top["model"], "model") if "model" in top else DEFAULT_MODEL
        fleet = self.fleet_reader.fleet(top["fleet"], default_model)
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
        steps = tuple(
            self.step_reader.step(node, join("steps", i), names)
            for i, node in enumerate(step_nodes)
        )
        self.check_steps(steps, step_nodes, discovery)
        if discovery == "kubernetes":
            self.check_pod_lifecycle(fleet, steps, step_nodes)
        else:
            self.check_no_pod_states(top["fleet"], fleet, steps, step_nodes)
        fleets = frozenset({"fake"})
        if "fleets" in top:
            items = r.sequence(top["fleets"], "fleets")
            kinds = [
                r.choice(item, join("fleets", index), FLEET_KINDS)
                for index, item in enumerate(items)
            ]
            if not kinds:
                raise r.fail(
                    top["fleets"], "fleets", f"names no fleet kind ({', '.join(FLEET_KINDS)})"
                )
            fleets = frozenset(kinds)
        if fleets & ENGINE_FLEETS:
            kind = sorted(fleets & ENGINE_FLEETS)[0]
            self.check_engine_fleet(top, fleet, steps, step_nodes, default_model, discovery, kind)
        if fleets & GRPC_FLEETS:
            kind = sorted(fleets & GRPC_FLEETS)[0]
            self.check_grpc_fleet(top, fleet, steps, step_nodes, discovery, kind)
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
        settings = self.settings_reader.settings(top.get("settings"))
        self.check_priorities(settings.priority_classes, steps, step_nodes)
        return Case(
            id=self.case_id,
            path=self.path,
            name=r.string(top["name"], "name"),
            description=r.string(top["description"], "description").strip(),
            tags=r.strings(top["tags"], "tags") if "tags" in top else (),
            requires=requires,
            fleet=fleet,
            settings=settings,
            steps=steps,
            discovery=discovery,
            fleets=fleets,
        )

    def check_priorities(
        self, classes: Sequence[str], steps: Sequence[Step], nodes: Sequence[Node]
    ) -> None:
        """A request's `priority` names one of the case's priority classes."""
        for index, (step, node) in enumerate(zip(steps, nodes, strict=True)):
            if isinstance(step, SendStep | PollStep) and step.request.priority is not None:
                if step.request.priority not in classes:
                    known = ", ".join(classes) if classes else "none: set settings.priority_classes"
                    raise self.r.fail(
                        node,
                        join(join("steps", index), "priority"),
                        f"{step.request.priority!r} is not a priority class ({known})",
                    )

    def check_engine_fleet(
        self,
        top: dict[str, Node],
        fleet: Sequence[WorkerSpec],
        steps: Sequence[Step],
        nodes: Sequence[Node],
        default_model: str,
        discovery: str | None,
        kind: str = "vllm",
    ) -> None:
        """What a case that runs on real engines (`fleets: [..., vllm]` or `vllm-grpc`)
        cannot ask for: a real engine has no scripted behaviour and no handoff record,
        serves the one model the runner's engines are started with, and is one mixed
        engine."""
        r = self.r
        where = "fleets"
        engine = f"a real engine (fleets: {kind})"
        if default_model != DEFAULT_MODEL:
            raise r.fail(top["model"], "model", f"a {kind} fleet serves {DEFAULT_MODEL!r} only")
        if discovery == "kubernetes":
            raise r.fail(top["discovery"], "discovery", f"a {kind} fleet is not discovered as Pods")
        nodes_by_name = {name: value for name, _, value in r.items(top["fleet"], "fleet")}
        for worker in fleet:
            field = join("fleet", worker.name)
            problem = (
                "has a scripted behaviour"
                if worker.behaviour
                else f"serves {worker.model!r}"
                if worker.model != DEFAULT_MODEL
                else f"is a {worker.role} worker"
                if worker.role != "mixed"
                else f"has dp_size {worker.dp_size}"
                if worker.dp_size != 1
                else "publishes KV events (kv_events)"
                if worker.kv_events
                else "holds LoRA adapters (lora_adapters)"
                if worker.lora_adapters is not None
                else None
            )
            if problem is not None:
                raise r.fail(
                    nodes_by_name[worker.name],
                    field,
                    f"{problem}; {engine} cannot (drop {kind} from `{where}`)",
                )
        for index, (step, node) in enumerate(zip(steps, nodes, strict=True)):
            field = join("steps", index)
            if isinstance(step, SetBehaviourStep):
                raise r.fail(
                    node,
                    join(field, "set_behaviour"),
                    f"{engine} has no scripted behaviour",
                )
            if isinstance(step, SendStep) and step.expect.handoffs is not None:
                raise r.fail(
                    node,
                    join(field, "expect"),
                    f"{engine} keeps no handoff record",
                )

    def check_grpc_fleet(
        self,
        top: dict[str, Node],
        fleet: Sequence[WorkerSpec],
        steps: Sequence[Step],
        nodes: Sequence[Node],
        discovery: str | None,
        kind: str,
    ) -> None:
        """What a case that runs on gRPC workers (`fleets: [..., grpc]` or `vllm-grpc`)
        cannot ask for: a gRPC worker serves mixed generation only (no PD role, no KV
        events, no embeddings), is given to the plane on its command line (no
        discovery), and speaks no HTTP a request past the plane could use."""
        r = self.r
        where = f"a gRPC worker (fleets: {kind})"
        if discovery is not None:
            raise r.fail(top["discovery"], "discovery", f"{where} is not discovered (drop {kind})")
        nodes_by_name = {name: value for name, _, value in r.items(top["fleet"], "fleet")}
        for worker in fleet:
            problem = (
                f"is a {worker.role} worker"
                if worker.role != "mixed"
                else "publishes KV events (kv_events)"
                if worker.kv_events
                else "holds LoRA adapters (lora_adapters)"
                if worker.lora_adapters is not None
                else None
            )
            if problem is not None:
                raise r.fail(
                    nodes_by_name[worker.name],
                    join("fleet", worker.name),
                    f"{problem}; {where} cannot (drop {kind} from `fleets`)",
                )
        for index, (step, node) in enumerate(zip(steps, nodes, strict=True)):
            if not isinstance(step, SendStep | PollStep):
                continue
            field = join("steps", index)
            if step.request.route not in GRPC_ROUTES:
                raise r.fail(
                    node,
                    field,
                    f"route {step.request.route} is not served by {where}: "
                    f"{', '.join(GRPC_ROUTES)}",
                )
            if isinstance(step, SendStep) and step.request.worker is not None:
                raise r.fail(
                    node, field, f"{where} takes no HTTP request past the plane (send.worker)"
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
        never = sorted(set(self.step_reader.background) - awaited)
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

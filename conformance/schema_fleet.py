"""The fleet part of a case: its fake workers (`WorkerSpec`) and the live behaviour a
worker starts with or a `set_behaviour` step gives it.

Part of the case schema (`conformance.schema`).
"""

from __future__ import annotations

from typing import Any

from yaml.nodes import Node

from conformance.model import (
    ALL_WORKERS,
    BEHAVIOUR_FIELDS,
    BUSIEST_WORKER,
    FAIL_MODES,
    ROLES,
    STATUSES,
    WorkerSpec,
)
from conformance.nodes import NodeReader, join

WORKER_FIELDS = (
    "model",
    "role",
    "dp_size",
    "bootstrap_port",
    "status",
    "behaviour",
    "kv_events",
    "lora_adapters",
    "max_loras",
    "engine",
)
ENGINES = ("sglang", "vllm")


class FleetReader:
    """Reads the workers of one case file; raises SpecError at the first problem."""

    def __init__(self, r: NodeReader) -> None:
        self.r = r

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
        if "max_loras" in m and "lora_adapters" not in m:
            raise r.fail(
                m["max_loras"],
                join(field, "max_loras"),
                "only a worker with lora_adapters (a vLLM engine) has adapter slots",
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
            kv_events=r.boolean(m["kv_events"], join(field, "kv_events"))
            if "kv_events" in m
            else False,
            lora_adapters=self.adapters(m["lora_adapters"], join(field, "lora_adapters"))
            if "lora_adapters" in m
            else None,
            max_loras=r.integer(m["max_loras"], join(field, "max_loras"), 1, 64)
            if "max_loras" in m
            else 1,
            engine=r.choice(m["engine"], join(field, "engine"), ENGINES)
            if "engine" in m
            else "sglang",
        )

    def adapters(self, node: Node, field: str) -> tuple[str, ...]:
        """A list of adapter names; an empty list is allowed (a vLLM engine holding none)."""
        r = self.r
        value = r.value(node, field)
        if not isinstance(value, list) or not all(isinstance(name, str) and name for name in value):
            raise r.fail(node, field, f"must be a list of adapter names, got {value!r}")
        return tuple(value)

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
            elif kind == "names":
                out[key] = list(r.strings(value, where))
            elif key == "fail_first":
                out[key] = r.integer(value, where, minimum=-1)
            elif key == "fail_status":
                out[key] = r.integer(value, where, 400, 599)
            else:
                out[key] = r.integer(value, where, minimum=0)
        return out

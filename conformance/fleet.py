"""A case's fleet: one fake worker process per `WorkerSpec`, each on a port of its own.

The fake workers are the runner's eyes: `/debug/routing` says what each one received
(dispatch counts, DP rank headers, PD handoff fields) and `/debug/behaviour` scripts what
it does next. A fake gRPC engine (`protocol="grpc"`, `router fake-worker --protocol
grpc`) serves them on a side port of its own (`RunningWorker.debug_url`), and the plane
gets its `grpc://` URL. They run as separate processes, so the runner stays a black box to every
plane and to the router's own code, and a `fault` step does to a process what a real
fault does: SIGKILL, SIGSTOP / SIGCONT, a new process on the same port.

`CaseFleet` is what the runner needs of a fleet; `conformance.engine_fleet` gives the
same for real vLLM engines.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import trio

from conformance.model import Case, WorkerSpec
from conformance.processes import Child, ProcessFailed, open_process

FAKE_WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "router.cli", "fake-worker")
LISTENING = re.compile(r"fake-worker listening on ((?:http|grpc)://\S+)")
# A fake gRPC engine's side port for /debug/*, printed after its own URL.
DEBUG_LISTENING = re.compile(r"fake-worker debug on (http://\S+)")
# Prefill workers advertise a bootstrap port nobody listens on (KV transfer is not faked).
FIRST_BOOTSTRAP_PORT = 20000
START_TIMEOUT_S = 20.0
# The prefix cache of a worker with `kv_events`: room for every prompt a case sends it.
KV_CACHE_TOKENS = 65536


class FleetError(RuntimeError):
    """A fake worker that did not start, or did not answer its debug endpoints."""


@dataclass(frozen=True, slots=True)
class RunningWorker:
    """A started fake worker: its spec and where it listens."""

    spec: WorkerSpec
    url: str
    bootstrap_port: int | None
    # Where its /debug/* endpoints are when not at `url` (a fake gRPC engine's side port).
    debug_url: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def control_url(self) -> str:
        """Where the runner reads its counters and scripts its behaviour."""
        return self.debug_url or self.url


class CaseFleet(Protocol):
    """What the runner needs of a case's fleet, fake or real."""

    workers: dict[str, RunningWorker]

    def __iter__(self) -> Iterator[RunningWorker]: ...

    async def routing(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        """Per worker, at least `dispatches`: generation requests it received so far."""
        ...

    async def set_behaviour(
        self, client: httpx.AsyncClient, names: Sequence[str], behaviour: Mapping[str, Any]
    ) -> None: ...

    async def fault(self, name: str, action: str) -> None:
        """Do `action` (a `FAULT_ACTIONS` word) to worker `name`'s process."""
        ...

    def crashed(self) -> list[str]:
        """Workers whose process exited when no fault killed it, with their last output."""
        ...


@dataclass(slots=True)
class Fleet:
    workers: dict[str, RunningWorker]
    children: dict[str, Child]
    nursery: trio.Nursery | None = None
    """Where each worker's process runs in a task of its own (open_fleet's nursery)."""
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    command: Sequence[str] = FAKE_WORKER_COMMAND
    protocol: str = "http"
    # Worker names a fault killed or stopped: they are not asked for their counters.
    down: set[str] = field(default_factory=set)
    killed: set[str] = field(default_factory=set)
    # The last counters read from each worker, and the dispatches of its earlier
    # processes (a restarted fake worker counts from zero again).
    last: dict[str, dict[str, Any]] = field(default_factory=dict)
    earlier: dict[str, int] = field(default_factory=dict)

    def __iter__(self) -> Iterator[RunningWorker]:
        return iter(self.workers.values())

    async def routing(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        """Every worker's `/debug/routing`, read concurrently; FleetError if one fails. A
        worker a fault took down keeps its last counters; a restarted one adds those of
        its earlier processes to its own."""
        answers = await _each(
            client,
            "GET",
            {
                name: (w.control_url + "/debug/routing", None)
                for name, w in self.workers.items()
                if name not in self.down
            },
        )
        for name, answer in answers.items():
            answer["dispatches"] = int(answer.get("dispatches", 0)) + self.earlier.get(name, 0)
            self.last[name] = answer
        return {name: self.last.get(name, {"dispatches": 0}) for name in self.workers}

    async def fault(self, name: str, action: str) -> None:
        child = self.children[name]
        if action in ("kill", "restart") and name not in self.down and not child.exited:
            # The counters as they stand: a dead process cannot be asked any more.
            async with httpx.AsyncClient() as client:
                await self.routing(client)
        if action == "stop":
            child.signal_group(signal.SIGSTOP)
            self.down.add(name)
        elif action == "resume":
            child.signal_group(signal.SIGCONT)
            if name not in self.killed:
                self.down.discard(name)
        else:
            child.signal_group(signal.SIGKILL)
            await child.process.wait()
            self.down.add(name)
            self.killed.add(name)
            if action == "restart":
                await self._restart(name)

    async def _restart(self, name: str) -> None:
        assert self.nursery is not None, "the fleet was not opened by open_fleet"
        worker = self.workers[name]
        port = int(worker.url.rsplit(":", 1)[1])
        host = worker.url.split("://", 1)[1].rsplit(":", 1)[0]
        debug_port = int(worker.debug_url.rsplit(":", 1)[1]) if worker.debug_url else 0
        argv = worker_argv(
            worker.spec, worker.bootstrap_port, self.command, host, port, self.protocol, debug_port
        )
        self.earlier[name] = int(self.last.get(name, {}).get("dispatches", 0))
        self.scopes[name].cancel()  # the dead process's task
        child, self.scopes[name] = await self.nursery.start(
            _run_worker, argv, f"fake worker {name}"
        )
        listening = None
        with trio.move_on_after(START_TIMEOUT_S):
            listening = await child.output.wait_for(LISTENING)
            if self.protocol == "grpc":
                await child.output.wait_for(DEBUG_LISTENING)
        if listening is None:
            raise FleetError(f"fake worker {name} did not start again:\n{child.output.tail(10)}")
        self.children[name] = child
        self.down.discard(name)
        self.killed.discard(name)
        if worker.spec.behaviour:
            async with httpx.AsyncClient() as client:
                await self.set_behaviour(client, [name], worker.spec.behaviour)

    async def set_behaviour(
        self, client: httpx.AsyncClient, names: Sequence[str], behaviour: Mapping[str, Any]
    ) -> None:
        calls = {
            name: (self.workers[name].control_url + "/debug/behaviour", dict(behaviour))
            for name in names
        }
        await _each(client, "POST", calls)

    def crashed(self) -> list[str]:
        """Workers whose process has exited when no fault killed it, with their last output."""
        return [
            f"fake worker {name} exited ({child.process.returncode}):\n{child.output.tail(10)}"
            for name, child in self.children.items()
            if child.exited and name not in self.killed
        ]


async def _each(
    client: httpx.AsyncClient, method: str, calls: Mapping[str, tuple[str, Any]]
) -> dict[str, dict[str, Any]]:
    """One JSON call per worker, concurrently; the answers by worker, or FleetError naming
    the first call that failed (raised here, outside the nursery, so it is not grouped)."""
    answers: dict[str, dict[str, Any]] = {}
    errors: list[str] = []

    async def call(name: str, url: str, payload: Any) -> None:
        try:
            response = await client.request(method, url, json=payload, timeout=5.0)
        except httpx.HTTPError as exc:
            errors.append(f"{method} {url}: {exc!r}")
            return
        if response.status_code != 200:
            errors.append(f"{method} {url}: {response.status_code} {response.text[:200]}")
            return
        answers[name] = response.json()

    async with trio.open_nursery() as nursery:
        for name, (url, payload) in calls.items():
            nursery.start_soon(call, name, url, payload)
    if errors:
        raise FleetError("; ".join(errors))
    return answers


def worker_argv(
    spec: WorkerSpec,
    bootstrap_port: int | None,
    command: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    protocol: str = "http",
    debug_port: int = 0,
) -> list[str]:
    argv = [
        *command,
        "--host",
        host,
        "--port",
        str(port),
        "--model",
        spec.model,
        "--role",
        spec.role,
        "--dp-size",
        str(spec.dp_size),
        "--shutdown-grace-s",
        "0",
    ]
    if bootstrap_port is not None:
        argv += ["--bootstrap-port", str(bootstrap_port)]
    if protocol == "grpc":
        argv += ["--protocol", "grpc", "--debug-port", str(debug_port)]
    if spec.kv_events:
        # vLLM's engine kind: `/kv_event_sources` is where a plane learns the publisher.
        argv += ["--engine", "vllm", "--cache-tokens", str(KV_CACHE_TOKENS), "--kv-events"]
    if spec.lora_adapters is not None:
        # vLLM's engine kind: its model list names the adapters with their parent, and it
        # answers 404 for a model it does not serve.
        argv += ["--engine", "vllm", "--max-loras", str(spec.max_loras)]
        if spec.lora_adapters:
            argv += ["--lora-adapters", ",".join(spec.lora_adapters)]
    if spec.engine != "sglang" and not spec.kv_events and spec.lora_adapters is None:
        argv += ["--engine", spec.engine]
    return argv


@asynccontextmanager
async def open_fleet(
    case: Case,
    client: httpx.AsyncClient,
    command: Sequence[str] = FAKE_WORKER_COMMAND,
    protocol: str = "http",
) -> AsyncIterator[Fleet]:
    """Start the case's fake workers, all listening and scripted before the block runs.

    `protocol="grpc"`: fake gRPC engines, each with its `/debug/*` on a side port.

    Every worker's starting behaviour is applied through `/debug/behaviour`, the same way
    a `set_behaviour` step changes it later. On exit (or cancellation) every worker is
    killed.

    In a case discovered through Kubernetes every worker listens on one port, each on a
    loopback address of its own (127.0.0.1, 127.0.0.2, ...): a Pod IP each, and one
    container port, which is all some planes take for every discovered Pod.
    """
    async with trio.open_nursery() as nursery:
        children: dict[str, Child] = {}
        scopes: dict[str, trio.CancelScope] = {}
        ports: dict[str, int | None] = {}
        shared_port: int | None = 0 if case.discovery == "kubernetes" else None
        for index, spec in enumerate(case.fleet):
            port = spec.bootstrap_port
            if spec.role == "prefill" and port is None:
                port = FIRST_BOOTSTRAP_PORT + index
            ports[spec.name] = port
            host = f"127.0.0.{index + 1}" if shared_port is not None else "127.0.0.1"
            argv = worker_argv(spec, port, command, host, shared_port or 0, protocol)
            child, scopes[spec.name] = await nursery.start(
                _run_worker, argv, f"fake worker {spec.name}"
            )
            children[spec.name] = child
            if shared_port == 0:  # the first worker picks the port the others share
                shared_port = await _listening_port(child)
        urls: dict[str, str] = {}
        debug_urls: dict[str, str] = {}
        problems: list[str] = []

        async def wait_listening(name: str) -> None:
            try:
                match = await children[name].output.wait_for(LISTENING)
                if protocol == "grpc":
                    debug = await children[name].output.wait_for(DEBUG_LISTENING)
                    debug_urls[name] = debug.group(1).rstrip("/")
            except ProcessFailed as exc:
                problems.append(str(exc))
                return
            urls[name] = match.group(1).rstrip("/")

        with trio.move_on_after(START_TIMEOUT_S):
            async with trio.open_nursery() as waiting:
                for name in children:
                    waiting.start_soon(wait_listening, name)
        if problems:
            raise FleetError("\n".join(problems))
        late = sorted(set(children) - set(urls))
        if late:
            raise FleetError(
                f"fake worker(s) {', '.join(late)} did not start within {START_TIMEOUT_S:g}s"
            )
        workers = {
            spec.name: RunningWorker(
                spec, urls[spec.name], ports[spec.name], debug_urls.get(spec.name)
            )
            for spec in case.fleet
        }
        fleet = Fleet(workers, children, nursery, scopes, command=command, protocol=protocol)
        for spec in case.fleet:
            if spec.behaviour:
                await fleet.set_behaviour(client, [spec.name], spec.behaviour)
        try:
            yield fleet
        finally:
            nursery.cancel_scope.cancel()


async def _run_worker(
    argv: Sequence[str],
    name: str,
    *,
    task_status: trio.TaskStatus[tuple[Child, trio.CancelScope]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One worker process for as long as its scope is not cancelled."""
    with trio.CancelScope() as scope:
        async with open_process(argv, name, stop_grace_s=0) as child:
            task_status.started((child, scope))
            await trio.sleep_forever()


async def _listening_port(child: Child) -> int:
    with trio.move_on_after(START_TIMEOUT_S):
        match = await child.output.wait_for(LISTENING)
        return int(match.group(1).rstrip("/").rsplit(":", 1)[1])
    raise FleetError(
        f"the first fake worker did not start within {START_TIMEOUT_S:g}s:\n{child.output.tail(10)}"
    )

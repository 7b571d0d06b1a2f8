"""A case's fleet: one fake worker process per `WorkerSpec`, each on a port of its own.

The fake workers are the runner's eyes: `/debug/routing` says what each one received
(dispatch counts, DP rank headers, PD handoff fields) and `/debug/behaviour` scripts what
it does next. They run as separate processes, so the runner stays a black box to every
plane and to the router's own code.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from conformance.model import Case, WorkerSpec
from conformance.processes import Child, ProcessFailed, open_process

FAKE_WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "router.cli", "fake-worker")
LISTENING = re.compile(r"fake-worker listening on (http://\S+)")
# Prefill workers advertise a bootstrap port nobody listens on (KV transfer is not faked).
FIRST_BOOTSTRAP_PORT = 20000
START_TIMEOUT_S = 20.0


class FleetError(RuntimeError):
    """A fake worker that did not start, or did not answer its debug endpoints."""


@dataclass(frozen=True, slots=True)
class RunningWorker:
    """A started fake worker: its spec and where it listens."""

    spec: WorkerSpec
    url: str
    bootstrap_port: int | None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(slots=True)
class Fleet:
    workers: dict[str, RunningWorker]
    children: dict[str, Child]

    def __iter__(self) -> Any:
        return iter(self.workers.values())

    async def routing(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        """Every worker's `/debug/routing`, read concurrently; FleetError if one fails."""
        return await _each(
            client,
            "GET",
            {name: (w.url + "/debug/routing", None) for name, w in self.workers.items()},
        )

    async def set_behaviour(
        self, client: httpx.AsyncClient, names: Sequence[str], behaviour: Mapping[str, Any]
    ) -> None:
        calls = {
            name: (self.workers[name].url + "/debug/behaviour", dict(behaviour)) for name in names
        }
        await _each(client, "POST", calls)

    def crashed(self) -> list[str]:
        """Workers whose process has exited, with their last output."""
        return [
            f"fake worker {name} exited ({child.process.returncode}):\n{child.output.tail(10)}"
            for name, child in self.children.items()
            if child.exited
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
    return argv


@asynccontextmanager
async def open_fleet(
    case: Case, client: httpx.AsyncClient, command: Sequence[str] = FAKE_WORKER_COMMAND
) -> AsyncIterator[Fleet]:
    """Start the case's fake workers, all listening and scripted before the block runs.

    Every worker's starting behaviour is applied through `/debug/behaviour`, the same way
    a `set_behaviour` step changes it later. On exit (or cancellation) every worker is
    killed.

    In a case discovered through Kubernetes every worker listens on one port, each on a
    loopback address of its own (127.0.0.1, 127.0.0.2, ...): a Pod IP each, and one
    container port, which is all some planes take for every discovered Pod.
    """
    async with AsyncExitStack() as stack:
        children: dict[str, Child] = {}
        ports: dict[str, int | None] = {}
        shared_port: int | None = 0 if case.discovery == "kubernetes" else None
        for index, spec in enumerate(case.fleet):
            port = spec.bootstrap_port
            if spec.role == "prefill" and port is None:
                port = FIRST_BOOTSTRAP_PORT + index
            ports[spec.name] = port
            host = f"127.0.0.{index + 1}" if shared_port is not None else "127.0.0.1"
            argv = worker_argv(spec, port, command, host, shared_port or 0)
            child = children[spec.name] = await stack.enter_async_context(
                open_process(argv, f"fake worker {spec.name}", stop_grace_s=0)
            )
            if shared_port == 0:  # the first worker picks the port the others share
                shared_port = await _listening_port(child)
        urls: dict[str, str] = {}
        problems: list[str] = []

        async def wait_listening(name: str) -> None:
            try:
                match = await children[name].output.wait_for(LISTENING)
            except ProcessFailed as exc:
                problems.append(str(exc))
                return
            urls[name] = match.group(1).rstrip("/")

        with trio.move_on_after(START_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for name in children:
                    nursery.start_soon(wait_listening, name)
        if problems:
            raise FleetError("\n".join(problems))
        late = sorted(set(children) - set(urls))
        if late:
            raise FleetError(
                f"fake worker(s) {', '.join(late)} did not start within {START_TIMEOUT_S:g}s"
            )
        workers = {
            spec.name: RunningWorker(spec, urls[spec.name], ports[spec.name]) for spec in case.fleet
        }
        fleet = Fleet(workers, children)
        for spec in case.fleet:
            if spec.behaviour:
                await fleet.set_behaviour(client, [spec.name], spec.behaviour)
        yield fleet


async def _listening_port(child: Child) -> int:
    with trio.move_on_after(START_TIMEOUT_S):
        match = await child.output.wait_for(LISTENING)
        return int(match.group(1).rstrip("/").rsplit(":", 1)[1])
    raise FleetError(
        f"the first fake worker did not start within {START_TIMEOUT_S:g}s:\n{child.output.tail(10)}"
    )

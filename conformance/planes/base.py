"""The plane adapter interface: everything the runner needs to know about one binary.

An adapter is a `Plane` subclass in one module. It says:

- `name`: how `conformance run --plane NAME` and the report call it;
- `capabilities`: what the plane can do at all (`breaker.single_probe`, `pd`, ...). A
  case needing one it lacks is reported `unsupported` and not run; `missing_notes` may
  say, per missing capability, what the plane was seen doing instead;
- `divergences`: the YAML file of cases where the plane is known to behave otherwise
  than the spec says, each with the observed behaviour and the reason; a plane with a
  gRPC path (`upstream.grpc`) keeps that path's in `grpc_divergences`, read on the fleets
  whose workers speak gRPC;
- `command(launch)`: the argv that starts it in front of a running fleet, with the case's
  neutral settings mapped to its flags. A setting it cannot express raises `Unsupported`;
- how it reports its address: `listen_pattern` (it binds port 0 and prints its URL) or
  none (the runner picks a free port and passes it in `launch.port`);
- `wait_ready`: when it has admitted the fleet (default: `/v1/models` lists every model);
- `request_headers`: how a request claims its priority class in the plane's words;
- `version_argv`: how to ask the plane's own binary or interpreter for its version; a
  plane that cannot answer is not installed, and `install_hint` says how to install it;
- `environment`: variables its processes get on top of the runner's;
- `start_sidecars`: what it needs running before itself (an etcd, a fake Kubernetes API),
  started through a runner-owned `Sidecars` that stops all of it when the case ends;
- `prepare`: an async step per case once the sidecars and the fleet run and before the
  plane starts (default: publish every worker of a discovery case). A discovery-only
  plane publishes a static fleet here too;
- `publish` / `withdraw`: how a worker's record appears in (or leaves) the discovery
  backend the plane follows.

Adding a plane is one module with such a subclass, registered in
`conformance.planes.PLANES` or named on the command line as `--plane module:Class`.
`docs/adding-a-plane.md` walks through one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import trio

from conformance.fleet import RunningWorker
from conformance.model import GRPC_FLEETS, Case, RequestSpec
from conformance.sidecars import Sidecars


class Unsupported(Exception):
    """The plane cannot run this case as written: the message says which setting and why."""


@dataclass(frozen=True, slots=True)
class Probe:
    """What asking a plane for its version found: the version, and, when it could not
    answer, one line saying what to install (None: it is there)."""

    version: str
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Launch:
    """What an adapter gets to build its command line from."""

    case: Case
    workers: Sequence[RunningWorker]
    host: str
    port: int  # 0 when the plane has a `listen_pattern`
    workdir: Path  # a private scratch folder for files the plane reads (fleet files, ...)
    sidecars: Sidecars  # what `start_sidecars` started for this case, and its `values`
    # True when the case runs only to be observed (`--run-unsupported`): an adapter may
    # then put a setting it lacks by one it has, and must say so with `substitute`.
    observe: bool = False
    substitutions: list[str] = field(default_factory=list)

    def substitute(self, setting: str, wanted: object, used: object, why: str = "") -> None:
        """Record that the plane runs `setting` as `used` instead of `wanted` (only while
        observing); the case's record shows it beside what was observed."""
        line = f"{setting}: {wanted} run as {used}" + (f" ({why})" if why else "")
        if line not in self.substitutions:
            self.substitutions.append(line)


class Plane(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()
    # For capabilities the plane lacks: what it does instead, as observed (shown in reports).
    missing_notes: ClassVar[Mapping[str, str]] = {}
    divergences: ClassVar[Path | None] = None
    # The divergences of its gRPC path (fleets of gRPC workers), when it has one.
    grpc_divergences: ClassVar[Path | None] = None
    # What to run when the plane is not installed (its `version_argv` fails), in one line.
    install_hint: ClassVar[str] = ""
    # When set, the plane is started on port 0 and its URL is read from its output.
    listen_pattern: ClassVar[re.Pattern[str] | None] = None
    stop_grace_s: ClassVar[float] = 2.0
    ready_timeout_s: ClassVar[float] = 30.0
    # The distribution whose version the default `version_argv` asks the interpreter for.
    distribution: ClassVar[str | None] = None
    # The interpreter the plane runs under (planes launched as `python -m ...`).
    interpreter: ClassVar[str] = sys.executable

    def version_argv(self) -> list[str] | None:
        """The command whose last output line is the plane's version, all of it (None:
        unknown).

        Default: the plane's interpreter reports the installed `distribution`. A binary
        plane answers `[binary, "--version"]` or the like: the version is asked of what
        runs, never read from the runner's own environment.
        """
        if self.distribution is None:
            return None
        code = f"import importlib.metadata as m; print(m.version({self.distribution!r}))"
        return [self.interpreter, "-c", code]

    def version(self) -> str:
        """The plane's version as its own binary or interpreter says it, for reports: the
        whole last line of `version_argv`'s output (`0.3.1+cpu (build 2026-11-02)` stays
        whole)."""
        return self.probe().version

    def probe(self) -> Probe:
        """Ask the plane's binary or interpreter for its version. One that cannot answer
        (missing, or failing) is not installed: `problem` then says what to install."""
        argv = self.version_argv()
        if argv is None:
            return Probe("unknown")
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
                env=environment_for(self.environment()),
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Probe(f"unknown ({type(exc).__name__})", self._not_installed(argv, str(exc)))
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        if done.returncode != 0 or not lines:
            error = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return Probe(f"unknown (exit {done.returncode})", self._not_installed(argv, error))
        return Probe(lines[-1])

    def _not_installed(self, argv: Sequence[str], why: str) -> str:
        hint = self.install_hint or (
            f"pip install {self.distribution}" if self.distribution else "install it"
        )
        return f"plane {self.name} is not installed ({argv[0]}: {why}): {hint}"

    def divergence_file(self, fleet: str) -> Path | None:
        """The divergences that hold on `fleet`: its gRPC path's on a fleet of gRPC
        workers, else its HTTP path's."""
        return self.grpc_divergences if fleet in GRPC_FLEETS else self.divergences

    def environment(self) -> Mapping[str, str]:
        """Variables every process of this plane (sidecars included) gets on top of the
        runner's environment. Default: none."""
        return {}

    def launch_environment(self, launch: Launch) -> Mapping[str, str]:
        """Variables the plane's own process gets for one case (a path a sidecar wrote,
        such as `KUBECONFIG`). Default: `environment()`."""
        return self.environment()

    async def start_sidecars(self, sidecars: Sidecars, case: Case) -> None:
        """Start what the plane needs before itself, through `sidecars` (which owns and
        stops it). Runs before the fleet starts. Default: nothing."""
        return None

    async def prepare(self, launch: Launch, client: httpx.AsyncClient) -> None:
        """Make the fleet known to the plane before it starts, once per case: the
        sidecars and the fake workers run, the plane does not yet (`launch.port` is not
        chosen). Default: for a case with `discovery`, publish every worker with its
        starting status; nothing for a static fleet, which goes on the command line.

        A discovery-only plane overrides it to publish a static fleet as well (its
        `start_sidecars` then starts the backend for every case).
        """
        if launch.case.discovery is not None:
            for worker in launch.workers:
                await self.publish(launch, client, worker, worker.spec.status)

    async def publish(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker, status: str
    ) -> None:
        """Make `worker`'s record, with `status` (`active`, `draining` or `not_ready`),
        visible in the discovery backend the plane follows. Called by `prepare` and by
        the steps that change the fleet (`set_status`, `add`)."""
        raise Unsupported(f"plane {self.name} publishes no worker records")

    async def withdraw(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker
    ) -> None:
        """Remove `worker`'s record from the discovery backend."""
        raise Unsupported(f"plane {self.name} withdraws no worker records")

    def check(self, case: Case) -> None:
        """Raise Unsupported when the case's settings cannot be expressed on this plane.

        Called before anything starts; `command` may raise it too. The default accepts
        every case.
        """
        return None

    @abstractmethod
    def command(self, launch: Launch) -> list[str]:
        """The argv that starts the plane in front of `launch.workers`."""

    def request_headers(self, launch: Launch, request: RequestSpec) -> dict[str, str]:
        """The headers that say what a request claims in the plane's own words (its priority
        class: `request.priority`). Default: none; a plane with `admission.priority` says
        how its clients name a class."""
        return {}

    def auth_headers(self, launch: Launch) -> dict[str, str]:
        """The client key a case sets, for the runner's own requests (readiness polls)."""
        key = launch.case.settings.api_key
        return {} if key is None else {"authorization": f"Bearer {key}"}

    async def wait_ready(self, client: httpx.AsyncClient, url: str, launch: Launch) -> None:
        """Return once the plane serves the fleet: `/v1/models` lists every model of it.

        Polls; the runner bounds the wait with `ready_timeout_s`.
        """
        wanted = {worker.spec.model for worker in launch.workers}

        def lists_every_model(answer: Any) -> bool:
            return wanted <= {entry.get("id") for entry in answer.get("data", [])}

        await wait_for_answer(
            client, url + "/v1/models", self.auth_headers(launch), lists_every_model, 0.05
        )


async def wait_for_answer(
    client: httpx.AsyncClient,
    url: str,
    headers: Mapping[str, str],
    ready: Callable[[Any], bool],
    interval_s: float,
) -> None:
    """Return once `GET url` answers 200 with a JSON body that `ready` accepts; ask again
    every `interval_s` while the plane refuses, errs or is not ready yet. The caller
    bounds the wait. Cancellation: nothing to undo."""
    while True:
        try:
            response = await client.get(url, timeout=2.0, headers=headers)
            if response.status_code == 200 and ready(response.json()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        await trio.sleep(interval_s)


def environment_for(extra: Mapping[str, str]) -> dict[str, str]:
    """The runner's environment with a plane's own variables on top."""
    return {**os.environ, **extra}

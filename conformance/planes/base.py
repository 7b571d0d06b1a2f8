"""The plane adapter interface: everything the runner needs to know about one binary.

An adapter is a `Plane` subclass in one module. It says:

- `name`: how `conformance run --plane NAME` and the report call it;
- `capabilities`: what the plane can do at all (`breaker.single_probe`, `pd`, ...). A
  case needing one it lacks is reported `unsupported` and not run; `missing_notes` may
  say, per missing capability, what the plane was seen doing instead;
- `divergences`: the YAML file of cases where the plane is known to behave otherwise
  than the spec says, each with the observed behaviour and the reason;
- `command(launch)`: the argv that starts it in front of a running fleet, with the case's
  neutral settings mapped to its flags. A setting it cannot express raises `Unsupported`;
- how it reports its address: `listen_pattern` (it binds port 0 and prints its URL) or
  none (the runner picks a free port and passes it in `launch.port`);
- `wait_ready`: when it has admitted the fleet (default: `/v1/models` lists every model).

Adding a third binary is one module with such a subclass, registered in
`conformance.planes.PLANES` or named on the command line as `--plane module:Class`.
"""

from __future__ import annotations

import importlib.metadata
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx
import trio

from conformance.fleet import RunningWorker
from conformance.model import Case


class Unsupported(Exception):
    """The plane cannot run this case as written: the message says which setting and why."""


@dataclass(frozen=True, slots=True)
class Launch:
    """What an adapter gets to build its command line from."""

    case: Case
    workers: Sequence[RunningWorker]
    host: str
    port: int  # 0 when the plane has a `listen_pattern`
    workdir: Path  # a private scratch folder for files the plane reads (fleet files, ...)


class Plane(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()
    # For capabilities the plane lacks: what it does instead, as observed (shown in reports).
    missing_notes: ClassVar[Mapping[str, str]] = {}
    divergences: ClassVar[Path | None] = None
    # When set, the plane is started on port 0 and its URL is read from its output.
    listen_pattern: ClassVar[re.Pattern[str] | None] = None
    stop_grace_s: ClassVar[float] = 2.0
    ready_timeout_s: ClassVar[float] = 30.0
    # The distribution whose version the report shows.
    distribution: ClassVar[str | None] = None

    def version(self) -> str:
        """`<distribution> <version>` as installed, for the report."""
        if self.distribution is None:
            return "unknown"
        try:
            return f"{self.distribution} {importlib.metadata.version(self.distribution)}"
        except importlib.metadata.PackageNotFoundError:
            return f"{self.distribution} (not installed)"

    def check(self, case: Case) -> None:
        """Raise Unsupported when the case's settings cannot be expressed on this plane.

        Called before anything starts; `command` may raise it too. The default accepts
        every case.
        """
        return None

    @abstractmethod
    def command(self, launch: Launch) -> list[str]:
        """The argv that starts the plane in front of `launch.workers`."""

    def auth_headers(self, launch: Launch) -> dict[str, str]:
        """The client key a case sets, for the runner's own requests (readiness polls)."""
        key = launch.case.settings.api_key
        return {} if key is None else {"authorization": f"Bearer {key}"}

    async def wait_ready(self, client: httpx.AsyncClient, url: str, launch: Launch) -> None:
        """Return once the plane serves the fleet: `/v1/models` lists every model of it.

        Polls; the runner bounds the wait with `ready_timeout_s`.
        """
        wanted = {worker.spec.model for worker in launch.workers}
        while True:
            try:
                response = await client.get(url + "/v1/models", timeout=2.0, headers=self.auth_headers(launch))
                if response.status_code == 200:
                    listed = {entry.get("id") for entry in response.json().get("data", [])}
                    if wanted <= listed:
                        return
            except (httpx.HTTPError, ValueError):
                pass
            await trio.sleep(0.05)

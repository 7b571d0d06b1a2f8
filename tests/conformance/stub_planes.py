"""Test-only planes: the naive stub router, and the same with a sidecar that forks.

`SidecarStubPlane` starts a dummy sidecar before itself. The sidecar ignores SIGTERM (so
only the runner's SIGKILL ends it) and forks a grandchild that sleeps; both, and the
plane, carry `STUB_MARK=<mark>` in their environment, so a test can find every process
the plane left by reading `/proc/*/environ`.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from conformance.model import Case
from conformance.planes.base import Launch, Plane, Unsupported
from conformance.sidecars import Sidecars

STUB_ROUTER = Path(__file__).with_name("stub_router.py")
MARK_VARIABLE = "STUB_MARK"
SIDECAR_CODE = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"sidecar ready {os.getpid()} {grandchild.pid}", flush=True)
time.sleep(600)
"""


class StubPlane(Plane):
    """Forwards JSON in turn to the workers; 500 to anything else; no body limit."""

    name = "stub"
    capabilities = frozenset({"policy.round_robin", "pd", "pd.bootstrap"})
    listen_pattern = re.compile(r"stub router listening on (http://\S+)")
    stop_grace_s = 0.5

    def version_argv(self) -> list[str]:
        return [sys.executable, "-c", "print('stub router'); print('0.0.1')"]

    def check(self, case: Case) -> None:
        if case.settings.max_body_bytes is not None:
            raise Unsupported("the stub router has no body limit to set")

    def command(self, launch: Launch) -> list[str]:
        models = {worker.spec.model for worker in launch.workers}
        return [
            sys.executable,
            str(STUB_ROUTER),
            "--model",
            sorted(models)[0],
            *(w.url for w in launch.workers),
        ]


class SidecarStubPlane(StubPlane):
    name = "stub-sidecar"
    # Mark of the processes of this plane: the runner's own when it has one (a test that
    # runs the CLI marks everything the runner starts), else a fresh one.
    mark: ClassVar[str] = os.environ.get(MARK_VARIABLE) or "conformance-stub-" + uuid.uuid4().hex

    def environment(self) -> Mapping[str, str]:
        return {MARK_VARIABLE: self.mark}

    async def start_sidecars(self, sidecars: Sidecars, case: Case) -> None:
        await sidecars.start(
            [sys.executable, "-c", SIDECAR_CODE],
            "dummy",
            ready_pattern=re.compile(r"sidecar ready"),
            stop_grace_s=0.5,
        )

"""What a run needs installed before it starts anything, checked up front, so that a
missing piece is one line naming what to install rather than a traceback halfway through.

A fleet of fake gRPC engines needs grpcio and smg-grpc-proto in the Python that runs the
fake workers (the runner's own); real engines need the engine venv and the model
(`make engine-env`), and over gRPC also the servicer in that venv and grpcio here (the
runner asks each engine's `HealthCheck`). A plane needs its binary
(`Plane.probe`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping

from conformance.engines import EngineEnvironment, EngineUnavailable
from conformance.model import ENGINE_FLEETS, GRPC_FLEETS

GRPC_MODULES = ("grpc", "smg_grpc_proto")
SERVICER_MODULE = "smg_grpc_servicer"


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The modules of `names` this interpreter cannot import."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def fleet_problem(fleet: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """One line saying what `fleet` lacks on this machine and how to install it; None
    when everything is there."""
    if fleet in GRPC_FLEETS and (missing := missing_modules(GRPC_MODULES)):
        return (
            f"--fleet {fleet} needs grpcio and smg-grpc-proto in {sys.executable} "
            f"(missing: {', '.join(missing)}): pip install 'trio-router[grpc]' "
            "(make setup installs them)"
        )
    if fleet not in ENGINE_FLEETS:
        return None
    try:
        environment = EngineEnvironment.from_env(environ)
    except EngineUnavailable as exc:
        return f"--fleet {fleet}: {exc}"
    if fleet in GRPC_FLEETS:
        probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({SERVICER_MODULE!r}) is None)"
        try:
            done = subprocess.run(
                [str(environment.python), "-c", probe],
                capture_output=True,
                timeout=60,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"--fleet {fleet}: the engine Python {environment.python} does not run ({exc}): run `make engine-env`"
        if done.returncode != 0:
            return (
                f"--fleet {fleet}: the engine Python {environment.python} has no "
                f"smg-grpc-servicer (vLLM's gRPC servicer): run `make engine-env`"
            )
    return None

"""The build hook: the request path compiled with mypyc when the project is installed, as
black and mypy ship theirs (docs/performance.md, "The compiled build").

`pip install .` compiles the modules `COMPILED` lists into C extensions beside their
sources, one shared library for all of them (calls between them stay native);
`ROUTER_PURE_PYTHON=1` builds the pure package instead, as mypy's `MYPY_USE_MYPYC=0`
does. Both builds behave the same; `router --version` and `router_build_info` say which
one runs. The compile needs a C compiler and Python's headers (`make build-deps`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent

# The request path: the HTTP server, the upstream pool, the app, the pipeline, the
# policies, the fleet's per-request pieces, the error tree, request ids and the tallies.
COMPILED = (
    "router/api/*.py",
    "router/edge/app.py",
    "router/fleet/breaker.py",
    "router/fleet/candidates.py",
    "router/fleet/load.py",
    "router/fleet/ranks.py",
    "router/fleet/records.py",
    "router/fleet/registry.py",
    "router/http/capped_reads.py",
    "router/http/clock.py",
    "router/http/direct_socket.py",
    "router/http/field_names.py",
    "router/http/server/*.py",
    "router/http/upstream/*.py",
    "router/http/wait_deadlines.py",
    "router/observability/metrics.py",
    "router/observability/request_id.py",
    "router/observability/tallies.py",
    "router/observability/tracing.py",
    "router/pipeline/*.py",
    "router/policies/*.py",
)
INTERPRETED = {
    # The ASGI adapter runs under hypercorn, off the native path: nothing to gain.
    "router/http/server/asgi.py",
}
# Commands that only read the project's metadata: setuptools runs this file for them too,
# and mypyc would type-check and translate the whole request path each time.
METADATA_COMMANDS = {"egg_info", "dist_info", "--name", "--version"}


def compiled_modules() -> list[str]:
    paths: list[str] = []
    for pattern in COMPILED:
        for path in sorted(ROOT.glob(pattern)):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in INTERPRETED and not relative.endswith("/__init__.py"):
                paths.append(relative)
    return paths


def ext_modules() -> list[object]:
    if os.environ.get("ROUTER_PURE_PYTHON", "") not in ("", "0"):
        return []
    if len(sys.argv) > 1 and sys.argv[1] in METADATA_COMMANDS:
        return []
    from mypyc.build import mypycify

    return list(
        mypycify(
            compiled_modules(),
            opt_level=os.environ.get("ROUTER_MYPYC_OPT_LEVEL", "3"),
            separate=False,  # one shared library: calls between compiled modules stay native
            multi_file=True,  # one C file per module: an edit recompiles only what changed
        )
    )


setup(ext_modules=ext_modules())

"""The build hook: the request path compiled with mypyc, as black and mypy ship theirs.

`pip install .` (or `-e .`) compiles the modules listed in HOT with mypyc: the same Python
source, built into C extensions beside it. `ROUTER_PURE_PYTHON=1` builds the pure-Python
package instead (like mypy's `MYPY_USE_MYPYC=0`); both builds behave the same, and
`router --version` says which one runs. Everything not listed stays interpreted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent

# The hot path: the HTTP server and the upstream pool, the request pipeline, the policies,
# the fleet's per-request pieces, the metrics binding and the error tree they raise.
HOT = [
    "router/http/direct_socket.py",
    "router/http/server/*.py",
    "router/http/upstream/*.py",
    "router/api/*.py",
    "router/fleet/breaker.py",
    "router/fleet/candidates.py",
    "router/fleet/ranks.py",
    "router/fleet/records.py",
    "router/fleet/registry.py",
    "router/observability/metrics.py",
    "router/policies/*.py",
    "router/pipeline/*.py",
]

# Left interpreted, each for the reason given.
INTERPRETED = {
    # The ASGI adapter runs under hypercorn, off the native path; nothing to gain.
    "router/http/server/asgi.py",
}


def hot_modules() -> list[str]:
    paths: list[str] = []
    for pattern in HOT:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in INTERPRETED and not rel.endswith("/__init__.py"):
                paths.append(rel)
    return paths


# Commands that only read the project's metadata: setuptools runs this file for each of
# them too, and mypyc would type-check and translate the whole request path every time.
METADATA_COMMANDS = {"egg_info", "dist_info", "--name", "--version"}


def ext_modules() -> list:
    if os.environ.get("ROUTER_PURE_PYTHON", "") not in ("", "0"):
        return []
    if len(sys.argv) > 1 and sys.argv[1] in METADATA_COMMANDS:
        return []
    from mypyc.build import mypycify

    return mypycify(
        hot_modules(),
        opt_level=os.environ.get("ROUTER_MYPYC_OPT_LEVEL", "3"),
        # One shared library for all of them: calls between compiled modules stay native.
        separate=False,
        # One C file per module: an edit recompiles only what changed.
        multi_file=True,
        verbose=bool(os.environ.get("ROUTER_MYPYC_VERBOSE")),
    )


setup(ext_modules=ext_modules())

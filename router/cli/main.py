"""`router` command line: one subcommand per job, each defined in its own module."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> module exposing `main(argv: list[str]) -> int`
SUBCOMMANDS = {
    "serve": ("router.cli.serve", "run the router in front of a fleet"),
    "fake-worker": (
        "router.fake_worker.cli",
        "run a GPU-free engine for tests, demos and benchmarks",
    ),
    "agent": ("router.agent.cli", "register an engine in etcd and drain it on SIGTERM"),
    "demo": ("router.cli.demo", "run the router in front of three embedded fake workers"),
}


def _usage() -> str:
    lines = ["usage: router <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "`router <command> --help` describes each command's options;"]
    lines += ["`router --version` says the version and the build (compiled or pure)."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from router import __version__
        from router.observability.runtime_metrics import build

        print(f"router {__version__} ({build()})")
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"router: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    result: int = module.main(rest)
    return result

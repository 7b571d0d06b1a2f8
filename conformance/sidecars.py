"""What a plane starts before itself for one case (an etcd, a fake Kubernetes API, a
launcher), owned by the runner and stopped whatever happens.

A plane adapter gets a `Sidecars` in `Plane.start_sidecars`. Every process it starts
there runs in a process group of its own; when the case ends (passed, failed, timed out,
or the runner interrupted) the runner stops every group, newest first, then runs the
cleanup callbacks. `values` carries what the plane needs later (a URL, a prefix) to its
`command`, `publish` and `withdraw`, for this case only: one plane object serves many
cases at once, so per-case state never lives on it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from conformance.processes import Child, ProcessFailed, open_process


class Sidecars:
    """The sidecars of one (case, plane) pair; made by `open_sidecars` only."""

    def __init__(self, stack: AsyncExitStack, env: Mapping[str, str], workdir: Path) -> None:
        self._stack = stack
        self._env = dict(env)
        self.workdir = workdir  # the case's private scratch folder (data dirs, config files)
        self.children: dict[str, Child] = {}
        self.values: dict[str, Any] = {}

    async def start(
        self,
        argv: Sequence[str],
        name: str,
        *,
        env: Mapping[str, str | None] | None = None,
        ready_pattern: re.Pattern[str] | None = None,
        ready_timeout_s: float = 20.0,
        stop_grace_s: float = 2.0,
    ) -> Child:
        """Start `argv` as the sidecar `name` with the plane's environment plus `env` (a
        None value unsets a variable).

        With `ready_pattern`, returns once a line of its output matches (ProcessFailed if
        it exits first or stays silent for `ready_timeout_s`). The process is stopped when
        the case ends: SIGTERM to its group, SIGKILL after `stop_grace_s`.
        """
        if name in self.children:
            raise ValueError(f"sidecar {name!r} started twice")
        child = await self._stack.enter_async_context(
            open_process(
                argv, f"sidecar {name}", stop_grace_s=stop_grace_s, env={**self._env, **(env or {})}
            )
        )
        self.children[name] = child
        if ready_pattern is not None:
            with trio.move_on_after(ready_timeout_s) as waited:
                await child.output.wait_for(ready_pattern)
            if waited.cancelled_caught:
                raise ProcessFailed(
                    f"sidecar {name} printed no line matching {ready_pattern.pattern!r} within "
                    f"{ready_timeout_s:g}s:\n{child.output.tail()}"
                )
        return child

    def on_stop(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` when the case ends, before the processes started so far stop."""
        self._stack.push_async_callback(callback)

    def crashed(self) -> list[str]:
        """Sidecars whose process has exited, with their last output."""
        return [
            f"sidecar {name} exited ({child.process.returncode}):\n{child.output.tail(10)}"
            for name, child in self.children.items()
            if child.exited
        ]


@asynccontextmanager
async def open_sidecars(env: Mapping[str, str], workdir: Path) -> AsyncIterator[Sidecars]:
    """A `Sidecars` whose processes and callbacks all end with the block, even on
    cancellation (each process stop runs shielded in `open_process`; a callback that must
    talk to the network shields itself)."""
    async with AsyncExitStack() as stack:
        yield Sidecars(stack, env, workdir)

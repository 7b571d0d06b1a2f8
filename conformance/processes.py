"""Child processes the runner owns: fake workers and planes, with their output kept.

`open_process` starts a command in a nursery of its own, drains its merged stdout and
stderr into an `OutputLog` (so a chatty process never blocks on a full pipe, and a
failure report can show its last lines), and stops it when the block exits: SIGTERM,
then SIGKILL once the grace is over.

Every child leads a process group of its own, and the signals go to the whole group: a
plane that is a launcher script in front of a binary, or a sidecar that forks, leaves
nothing behind. Whatever is still in the group once the child has exited is killed too,
and the block waits (up to `GROUP_EXIT_WAIT_S`) until none of it is alive: a SIGKILLed
process takes a moment to die, and a caller that looks right after must find it gone.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio

LOG_LINES = 300
GROUP_EXIT_WAIT_S = 5.0
"""How long leaving `open_process` waits for the SIGKILLed members of its group to die."""


class ProcessFailed(RuntimeError):
    """A child process that exited, or never said what was waited for."""


@dataclass(slots=True)
class LineCount:
    """How many lines matching `pattern` a process printed since the count was made."""

    pattern: re.Pattern[str]
    count: int = 0


@dataclass(slots=True)
class OutputLog:
    """The last lines a process printed, a way to wait for one that matches, and counts
    of the lines that match a pattern (kept as they arrive: the lines themselves are
    only the last LOG_LINES)."""

    name: str
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    total: int = 0
    closed: bool = False
    _changed: trio.Event = field(default_factory=trio.Event)
    _counts: list[LineCount] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.total += 1
        for counted in self._counts:
            if counted.pattern.search(line):
                counted.count += 1
        self._wake()

    def count(self, pattern: re.Pattern[str]) -> LineCount:
        """Count the lines matching `pattern` from now on."""
        counted = LineCount(pattern)
        self._counts.append(counted)
        return counted

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def tail(self, count: int = 25) -> str:
        return "\n".join(list(self.lines)[-count:])

    async def wait_for(self, pattern: re.Pattern[str]) -> re.Match[str]:
        """The first line (already printed or still to come) that matches `pattern`.

        Raises ProcessFailed if the output ends first. Cancellation: nothing to undo.
        """
        seen = 0
        while True:
            # Only lines added since the last look; the deque may have dropped older ones.
            fresh = min(self.total - seen, len(self.lines))
            for line in list(self.lines)[len(self.lines) - fresh :]:
                match = pattern.search(line)
                if match:
                    return match
            seen = self.total
            if self.closed:
                raise ProcessFailed(
                    f"{self.name} exited before printing {pattern.pattern!r}:\n{self.tail()}"
                )
            await self._changed.wait()


@dataclass(slots=True)
class Child:
    process: trio.Process
    output: OutputLog

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None

    def signal_group(self, signum: int) -> None:
        """Signal the child's whole process group (nothing when it is gone)."""
        _signal_group(self.process, signum)


def _signal_group(process: trio.Process, signum: int) -> None:
    """Signal the child's process group (its pid: it leads the group it was started in)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


async def _stop(grace_s: float, process: trio.Process) -> None:
    """trio's `deliver_cancel` hook: SIGTERM to the group, then SIGKILL after `grace_s`."""
    if grace_s > 0:
        _signal_group(process, signal.SIGTERM)
        with trio.move_on_after(grace_s):
            await process.wait()
            _signal_group(process, signal.SIGKILL)
            return
    _signal_group(process, signal.SIGKILL)


async def _drain(stream: trio.abc.ReceiveStream, log: OutputLog) -> None:
    pending = b""
    try:
        async for chunk in stream:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                log.add(_clean(raw))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    if pending:
        log.add(_clean(pending))
    log.close()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _clean(raw: bytes) -> str:
    return _ANSI.sub("", raw.decode("utf-8", "replace").rstrip("\r"))


@asynccontextmanager
async def open_process(
    argv: Sequence[str],
    name: str,
    *,
    stop_grace_s: float = 1.0,
    env: Mapping[str, str | None] | None = None,
) -> AsyncIterator[Child]:
    """Run `argv` for the duration of the block, in a process group of its own.

    Leaving the block (or cancellation) stops the group: SIGTERM, SIGKILL after
    `stop_grace_s` (0: SIGKILL at once), and waits for the child to exit. Members of the
    group still alive after that (grandchildren) get SIGKILL.
    """
    # `env` goes on top of the runner's environment; a None value unsets a variable.
    merged: dict[str, str | None] = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    full_env = {key: value for key, value in merged.items() if value is not None}
    log = OutputLog(name)
    async with trio.open_nursery() as nursery:
        try:
            process: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    check=False,
                    env=full_env,
                    start_new_session=True,
                    deliver_cancel=partial(_stop, stop_grace_s),
                )
            )
        except OSError as exc:  # a missing binary is the case's problem, not the runner's
            raise ProcessFailed(
                f"{name} could not start ({argv[0]}): {exc.strerror or exc}"
            ) from None
        assert process.stdout is not None
        nursery.start_soon(_drain, process.stdout, log)
        try:
            yield Child(process, log)
        finally:
            nursery.cancel_scope.cancel()
    # The child has exited and been reaped; its group may still hold grandchildren.
    _signal_group(process, signal.SIGKILL)
    with trio.CancelScope(shield=True), trio.move_on_after(GROUP_EXIT_WAIT_S):
        while live_group_members(process.pid):  # noqa: ASYNC110 - no event tells of a grandchild's death
            await trio.sleep(0.01)


def live_group_members(group: int) -> list[int]:
    """The processes of group `group` that are not zombies (a zombie is dead; its new
    parent reaps it), read from /proc; [] where there is no /proc to read."""
    members = []
    try:
        entries = os.scandir("/proc")
    except OSError:
        return []
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    # After the command's name (in parentheses, maybe with spaces): the
                    # state, the parent, then the process group.
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == group and fields[0] != b"Z":
                members.append(int(entry.name))
    return members


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now, for a program that cannot bind port 0 itself.

    Another process may take it before the program binds it; callers that see a bind
    failure try again with a new port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port

"""`router <command>` as a subprocess, the way a user runs it, for end-to-end tests.

`open_cli`: stdout is a pipe (commands print their URL there); stderr goes to a log file
the test can print when it fails. `open_cli_piped`: both are pipes whose lines a task
reads as they come (`Output`), for a test that waits for what the process logs. On exit a
process still running is killed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO

import orjson
import trio

REPO = Path(__file__).resolve().parents[2]


def _open_log(path: Path) -> IO[bytes]:
    return path.open("ab")


@asynccontextmanager
async def open_cli(args: Sequence[str], *, log_path: Path) -> AsyncIterator[trio.Process]:
    log = _open_log(log_path)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "router.cli", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=REPO,
        )
    finally:
        log.close()
    try:
        yield process
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


async def read_line(stream: trio.abc.ReceiveStream | None) -> str:
    assert stream is not None
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            break
        line += chunk
    return line.decode()


def sse_text(body: bytes) -> tuple[str, bool]:
    """The concatenated chat delta text of an SSE body, and whether it ended with [DONE]."""
    text = []
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    for data in events:
        if data == b"[DONE]":
            continue
        for choice in orjson.loads(data).get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), bool(events) and events[-1] == b"[DONE]"


class Output:
    """The lines a child process writes to one pipe, read by a task as they come."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._changed = trio.Event()
        self._ended = False

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        pending = b""
        while chunk := await stream.receive_some(65536):
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in complete]
            self._changed.set()
            self._changed = trio.Event()
        if pending:
            self.lines.append(pending.decode(errors="replace"))
        self._ended = True
        self._changed.set()

    async def wait_for(self, pattern: str | re.Pattern[str]) -> re.Match[str]:
        """The first line matching `pattern`, once it has been written; an
        AssertionError if the pipe closes without one."""
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if match := re.search(pattern, line):
                    return match
            seen = len(self.lines)
            if self._ended:
                raise AssertionError(f"no line matching {pattern!r} before the output ended")
            await self._changed.wait()

    async def url(self, pattern: str | re.Pattern[str]) -> str:
        """What the first group of `pattern` captures (the URL a process says it listens
        on), once a line matching it has been written."""
        return (await self.wait_for(pattern)).group(1)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@asynccontextmanager
async def open_cli_piped(*args: str) -> AsyncIterator[tuple[trio.Process, Output, Output]]:
    """`python -m router.cli ARGS` with its stdout and stderr read as they come; killed on
    exit if it is still running."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "router.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    stdout, stderr = Output(), Output()
    assert process.stdout is not None and process.stderr is not None
    async with process.stdout, process.stderr, trio.open_nursery() as nursery:
        nursery.start_soon(stdout.pump, process.stdout)
        nursery.start_soon(stderr.pump, process.stderr)
        try:
            yield process, stdout, stderr
        finally:
            if process.returncode is None:
                process.kill()
            with trio.move_on_after(5, shield=True):
                await process.wait()


async def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """`python -m router.cli ARGS` to its end, its output captured."""
    return await trio.run_process(
        [sys.executable, "-m", "router.cli", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
    )

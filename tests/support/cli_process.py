"""`router <command>` as a subprocess, the way a user runs it, for end-to-end tests.

stdout is a pipe (commands print their URL there); stderr goes to a log file the test can
print when it fails. On exit a process still running is killed.
"""

from __future__ import annotations

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

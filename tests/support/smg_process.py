"""The SGLang Model Gateway (`smg`, the Rust plane) as a subprocess, for the tests that run
it beside our router."""

from __future__ import annotations

import signal
import sys

import trio


def smg_command(*args: str, port: int, metrics_port: int) -> list[str]:
    """`python -m smg launch ARGS`: round robin, on 127.0.0.1:`port` with its metrics on
    `metrics_port`, a 1 s shutdown grace, warnings only."""
    return [
        sys.executable,
        "-m",
        "smg",
        "launch",
        *args,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--shutdown-grace-period-secs",
        "1",
        "--log-level",
        "warn",
    ]


async def stop_smg(process: trio.Process) -> None:
    """SIGTERM, then a kill if it is still there after 10 s. Shielded: runs on the way out."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()

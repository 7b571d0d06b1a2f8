"""`router fake-worker --protocol grpc` in a process of its own, for tests of trio code
that talks gRPC to it (grpcio's server runs on asyncio, so it cannot share the test's
loop). One per test module: its behaviour and counters are set and reset per test
through its side port."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.cli_process import REPO

STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class FakeGrpcEngine:
    url: str
    """`grpc://127.0.0.1:<port>`"""
    debug: str
    """The side port's base URL (`/debug/*`)."""
    model_dir: Path

    async def behave(self, **behaviour: Any) -> None:
        """Set its behaviour (`POST /debug/behaviour`) and zero its counters; what is not
        named goes back to no failures and healthy."""
        body = {"fail_first": 0, "fail_mode": "status", "fail_status": 503, "healthy": True}
        body.update(behaviour)
        async with httpx.AsyncClient(timeout=10) as http:
            (await http.post(self.debug + "/debug/behaviour", json=body)).raise_for_status()
            (await http.post(self.debug + "/debug/reset")).raise_for_status()

    async def routing(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10) as http:
            answer: dict[str, Any] = (await http.get(self.debug + "/debug/routing")).json()
            return answer


@contextmanager
def fake_grpc_engine(model_dir: Path, *args: str) -> Iterator[FakeGrpcEngine]:
    """Start it (flags `args`, tokenizer files written to `model_dir`), stop it at exit."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "fake-worker",
            "--protocol",
            "grpc",
            "--model-dir",
            str(model_dir),
            *args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        listening = process.stdout.readline()
        debug = process.stdout.readline()
        if not listening.startswith("fake-worker listening on grpc://"):
            raise RuntimeError(f"the fake gRPC engine did not start: {listening!r}")
        yield FakeGrpcEngine(listening.split()[-1], debug.split()[-1], model_dir)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

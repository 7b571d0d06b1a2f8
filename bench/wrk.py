"""wrk as the load generator: a Lua script for the POST body and for exact results.

wrk's own summary rounds its figures for display; the script's `done` hook prints the raw
counts and latency percentiles (microseconds) as one JSON line instead.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError

RESULT_MARK = "BENCH_RESULT "
TIMEOUT_S = 5

_LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
{headers}wrk.body = [==[{body}]==]

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{mark}{{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"status":%d,"timeout":%d,"p50_us":%d,"p99_us":%d,"max_us":%d}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    errors: int
    p50_ms: float
    p99_ms: float
    wrk_cpu_s: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def find_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise BenchError(
            "wrk is not installed (Debian/Ubuntu: apt-get install wrk; or `make system-deps`)"
        )
    return path


def write_script(
    directory: Path, name: str, body: bytes, headers: Mapping[str, str] | None = None
) -> Path:
    """A Lua script that POSTs `body` (JSON), with `headers` beside its content type, and
    reports raw results."""
    text = body.decode()
    if "]==]" in text:
        raise ValueError("the body cannot hold the Lua long-bracket terminator")
    lines = "".join(
        f"wrk.headers[{json.dumps(key)}] = {json.dumps(value)}\n"
        for key, value in (headers or {}).items()
    )
    path = directory / f"{name}.lua"
    path.write_text(_LUA.format(body=text, mark=RESULT_MARK, headers=lines))
    return path


def run_wrk(wrk: str, url: str, script: Path, connections: int, duration_s: int) -> WrkResult:
    """One wrk run: one thread, `connections` keep-alive connections, `duration_s` seconds.

    wrk's CPU is the change in this process's reaped-children usage around the run (wrk is
    the only child that exits meanwhile).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(
        [
            wrk,
            "-t1",
            f"-c{connections}",
            f"-d{duration_s}s",
            f"--timeout={TIMEOUT_S}s",
            "--latency",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        timeout=duration_s + TIMEOUT_S + 30,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    line = next((ln for ln in completed.stdout.splitlines() if ln.startswith(RESULT_MARK)), None)
    if completed.returncode != 0 or line is None:
        raise BenchError(
            f"wrk failed ({completed.returncode}): {completed.stderr or completed.stdout}"
        )
    data = json.loads(line[len(RESULT_MARK) :])
    errors = sum(data[key] for key in ("connect", "read", "write", "status", "timeout"))
    return WrkResult(
        requests=data["requests"],
        duration_s=data["duration_us"] / 1e6,
        errors=errors,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        wrk_cpu_s=wrk_cpu,
    )

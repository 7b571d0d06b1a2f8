"""The processes under test: start them, know when they are ready, read their CPU and memory
from /proc, and stop them.

Every process logs to a file of its own (a pipe nobody reads would fill up and stall it),
and readiness is a line in that file or an answer on its port, polled under a deadline.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_KB = 1  # VmRSS and VmHWM are reported in kB already
NOFILE_WANTED = 65536
STOP_GRACE_S = 3.0


# A process starts in about a second on a quiet machine; a CI run's smoke test once saw
# over 30 s at load 18 (three engines beside the suite). Only a bound on a hang.
START_TIMEOUT_S = 90.0


class BenchError(RuntimeError):
    """The bench cannot go on: a process did not start, a tool is missing."""


def raise_nofile_limit() -> int:
    """Raise this process's open-file limit (children inherit it); returns the new soft limit.

    Ten thousand streams through a router hold twenty thousand sockets in it, more than the
    usual limit. Raising the hard limit needs privilege; without it the soft limit goes up
    to the hard one.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        wanted = max(NOFILE_WANTED, soft)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(wanted, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    """A port nobody listens on right now (the kernel's pick for port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants alive now."""
    pids = [pid]
    index = 0
    while index < len(pids):
        for task in _listdir(f"/proc/{pids[index]}/task"):
            try:
                children = Path(f"/proc/{pids[index]}/task/{task}/children").read_text()
            except OSError:
                continue
            pids.extend(int(child) for child in children.split())
        index += 1
    return pids


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU of `pids` (all their threads), in seconds."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces; the fields after its closing ')' do not.
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def memory_kb(pids: Sequence[int], key: str = "VmHWM") -> int:
    """The sum of `key` ("VmHWM": peak resident, "VmRSS": resident now) over `pids`, in kB."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        match = re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)
        if match:
            total += int(match.group(1)) * PAGE_KB
    return total


@dataclass
class Proc:
    """One started process, its log file, and the pids of its tree once it is ready."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    pids: list[int] = field(default_factory=list)
    own_group: bool = False
    """Started as the leader of a process group of its own, and stopped by that group."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_log(
        self, pattern: str, count: int = 1, timeout_s: float = START_TIMEOUT_S
    ) -> list[str]:
        """The first `count` matches of `pattern` in the log, polled until `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            matches = re.findall(pattern, self.log_text())
            if len(matches) >= count:
                return matches[:count]
            self._check_alive(f"before its log showed {pattern!r}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: no {pattern!r} within {timeout_s}s\n{self._tail()}")
            time.sleep(0.05)

    def wait_for_answer(self, url: str, body: bytes, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll `url` with a POST of `body` until it answers 200."""
        deadline = time.monotonic() + timeout_s
        last = ""
        with httpx.Client(timeout=2.0) as client:
            while True:
                try:
                    response = client.post(
                        url, content=body, headers={"content-type": "application/json"}
                    )
                    if response.status_code == 200:
                        return
                    last = f"status {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                self._check_alive("before it answered")
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.name}: {url} not ready ({last})\n{self._tail()}")
                time.sleep(0.1)

    def settle_tree(self, count: int) -> None:
        """Record the process tree once it has `count` processes (the parent included)."""
        deadline = time.monotonic() + 10.0
        while True:
            self.pids = process_tree(self.pid)
            if len(self.pids) >= count:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: {len(self.pids)} processes, expected {count}")
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pids)

    def peak_rss_kb(self) -> int:
        return memory_kb(self.pids, "VmHWM")

    def rss_kb(self) -> int:
        return memory_kb(self.pids, "VmRSS")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole tree after a short grace (to the whole group,
        for a process started in a group of its own)."""
        if self.own_group:
            self._stop_group()
            return
        if self.popen.poll() is not None:
            return
        tree = process_tree(self.pid)
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        for pid in reversed(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass

    def _stop_group(self) -> None:
        # The group outlives a leader that died first, so it is signalled regardless.
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=STOP_GRACE_S)

    def _check_alive(self, when: str) -> None:
        code = self.popen.poll()
        if code is not None:
            raise BenchError(f"{self.name} exited with status {code} {when}\n{self._tail()}")

    def _tail(self) -> str:
        lines = self.log_text().splitlines()[-15:]
        return "\n".join(f"  | {line}" for line in lines)


def start(
    name: str,
    command: Sequence[str],
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    *,
    own_group: bool = False,
) -> Proc:
    """Start `command` with stdout and stderr to `<log_dir>/<name>.log`, and `env` on top
    of this process's environment; with `own_group`, as the leader of a new process group
    (`stop()` then signals the group)."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=own_group,
        )
    return Proc(name=name, popen=popen, log_path=log_path, own_group=own_group)


def python_module(*args: str) -> list[str]:
    """A command running `python -m <args>` with this interpreter."""
    return [sys.executable, "-m", *args]


def smg_launch(urls: Sequence[str], port: int, metrics_port: int | None = None) -> list[str]:
    """smg in front of `urls` with round robin on 127.0.0.1:`port`; its metrics on
    `metrics_port` (None: smg's default, 29000, which two smg processes cannot share)."""
    command = python_module(
        "smg",
        "launch",
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    if metrics_port is not None:
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return command

"""A real single-member etcd for tests, on free loopback ports with its own data dir.

`open_etcd_server` starts it and stops it on exit; the yielded `EtcdServer` can stop,
kill and restart the same member (same data dir, same ports), compact its history and
count the watch streams it holds.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO

import httpx
import orjson
import trio

from tests.support.ports import free_ports

ETCD_BINARY = "etcd"
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0

# etcd 3.4 refuses to start on architectures it does not list unless told this variable
# names the running one; it is harmless where the architecture is supported.
_GOARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
    "armv7l": "arm",
    "i686": "386",
}


def etcd_available() -> bool:
    return shutil.which(ETCD_BINARY) is not None


def _open_log(path: Path) -> IO[bytes]:
    return path.open("ab")


class EtcdServer:
    """One etcd member process; `start` may be called again after `stop` or `kill`."""

    def __init__(
        self, data_dir: Path, *, progress_interval_s: float = 1.0, name: str = "test"
    ) -> None:
        self.data_dir = data_dir
        self.name = name
        self.progress_interval_s = progress_interval_s
        self.client_port, self.peer_port = free_ports(2)
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.starts = 0
        self._process: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    def _argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            ETCD_BINARY,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--experimental-watch-progress-notify-interval",
            f"{self.progress_interval_s}s",
        ]

    def _env(self) -> dict[str, str]:
        # Inherited ETCD_* variables would silently override the flags above.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        env["ETCD_UNSUPPORTED_ARCH"] = _GOARCH.get(platform.machine().lower(), "")
        return env

    async def start(self) -> None:
        """Spawn etcd and return once it reports healthy; raise with its log if it cannot."""
        if self.running:
            raise RuntimeError("etcd is already running")
        log = _open_log(self.log_path)
        try:
            self._process = await trio.lowlevel.open_process(
                self._argv(), stdout=log, stderr=subprocess.STDOUT, env=self._env()
            )
        finally:
            log.close()
        self.starts += 1
        try:
            with trio.fail_after(READY_TIMEOUT_S):
                await self._wait_healthy()
        except BaseException:
            with trio.move_on_after(STOP_TIMEOUT_S, shield=True):
                await self.kill()
            raise

    async def _wait_healthy(self) -> None:
        async with httpx.AsyncClient(timeout=1.0) as http:
            while True:
                if not self.running:
                    raise RuntimeError(f"etcd exited during startup:\n{await self.log_tail()}")
                try:
                    response = await http.get(self.url + "/health")
                    if response.status_code == 200 and orjson.loads(response.content).get(
                        "health"
                    ) in ("true", True):
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.05)

    async def log_tail(self, lines: int = 30) -> str:
        text = await trio.Path(self.log_path).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if etcd has not exited within STOP_TIMEOUT_S."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_TIMEOUT_S):
            await process.wait()
            return
        await self.kill()

    async def kill(self) -> None:
        """SIGKILL: the member vanishes without closing its streams politely."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.kill()
        await process.wait()

    def freeze(self) -> None:
        """SIGSTOP: the member keeps every connection open and answers nothing."""
        assert self._process is not None and self._process.returncode is None
        self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after `freeze`."""
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGCONT)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def compact(self, revision: int) -> None:
        """Compact history before `revision` and wait until it is applied."""
        async with httpx.AsyncClient(timeout=5.0) as http:
            response = await http.post(
                self.url + "/v3/kv/compaction",
                content=orjson.dumps({"revision": str(revision), "physical": True}),
            )
        if response.status_code != 200:
            raise RuntimeError(f"compaction failed: {response.status_code} {response.text}")

    async def watch_streams(self) -> int:
        """Watch streams etcd holds open right now, from its own metrics."""
        async with httpx.AsyncClient(timeout=5.0) as http:
            response = await http.get(self.url + "/metrics")
        match = re.search(r"^etcd_debugging_mvcc_watch_stream_total (\S+)$", response.text, re.M)
        if match is None:
            raise RuntimeError("etcd does not report etcd_debugging_mvcc_watch_stream_total")
        return int(float(match.group(1)))

    async def wait_watch_streams(self, count: int) -> None:
        """Poll the metric until etcd holds exactly `count` watch streams.

        etcd offers no way to be told, and the gateway tears a stream down a moment after
        its HTTP connection closes, so polling is the only honest wait.
        """
        while True:
            if await self.watch_streams() == count:
                return
            await trio.sleep(0.05)


@asynccontextmanager
async def open_etcd_server(
    data_dir: Path, *, progress_interval_s: float = 1.0
) -> AsyncIterator[EtcdServer]:
    """A running etcd member; stopped (killed if it lingers) on exit, even on cancellation."""
    server = EtcdServer(data_dir, progress_interval_s=progress_interval_s)
    await server.start()
    try:
        yield server
    finally:
        with trio.move_on_after(STOP_TIMEOUT_S + 5, shield=True):
            await server.stop()

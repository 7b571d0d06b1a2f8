"""`router serve` as an operator runs it: a subprocess in front of a fake-worker subprocess,
stopped with SIGTERM while a stream is in flight, and its exit statuses."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

REPO = Path(__file__).resolve().parents[2]
TOKENS = 100
TOKEN_LATENCY_MS = 20  # the stream lasts about two seconds


class Output:
    """The lines a child process writes to one pipe, read by a task as they come."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._changed = trio.Event()

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
        self._changed.set()

    async def wait_for(self, pattern: str) -> re.Match[str]:
        """The first line matching `pattern`, once it has been written."""
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if match := re.search(pattern, line):
                    return match
            seen = len(self.lines)
            await self._changed.wait()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@asynccontextmanager
async def _child(*args: str) -> AsyncIterator[tuple[trio.Process, Output, Output]]:
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


async def _wait_refused(port: int) -> None:
    """Return once a connection to `port` is refused. The signal is logged a moment
    before the server closes its listener, so a connection may still get in first."""
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        await stream.aclose()
        await trio.sleep(0.01)


async def _run(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "router.cli", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
    )


async def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0() -> None:
    with trio.fail_after(30):
        async with _child(
            "fake-worker",
            "--port",
            "0",
            "--tokens",
            str(TOKENS),
            "--token-latency-ms",
            str(TOKEN_LATENCY_MS),
        ) as (worker, worker_out, _):
            worker_url = (
                await worker_out.wait_for(r"^fake-worker listening on (http://\S+)$")
            ).group(1)
            async with _child(
                "serve", "--port", "0", "--worker", worker_url, "--shutdown-grace-s", "60"
            ) as (router, _, router_err):
                router_url = (
                    await router_err.wait_for(r"router listening on (http://\S+) with 1 workers")
                ).group(1)
                body = {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                }
                async with (
                    httpx.AsyncClient(base_url=router_url, timeout=10) as client,
                    client.stream("POST", "/v1/chat/completions", json=body) as stream,
                ):
                    assert stream.status_code == 200
                    assert stream.headers["x-router-worker"] == worker_url
                    chunks = stream.aiter_raw()
                    received = [await anext(chunks)]
                    router.send_signal(signal.SIGTERM)
                    await router_err.wait_for(r"SIGTERM: no new connections")
                    # The listener closes at once: nobody new gets in while the stream goes on.
                    with trio.fail_after(1):
                        await _wait_refused(int(router_url.rsplit(":", 1)[1]))
                    received += [chunk async for chunk in chunks]
                stream_done = trio.current_time()
                # Grace is 60 s: exiting now means the router left as soon as it drained.
                assert await router.wait() == 0
                assert trio.current_time() - stream_done < 5
            text = b"".join(received).decode()
            async with httpx.AsyncClient(base_url=worker_url) as client:
                routing = (await client.get("/debug/routing")).json()
            worker.send_signal(signal.SIGTERM)
            assert await worker.wait() == 0
    assert text.endswith("data: [DONE]\n\n")
    assert "event: error" not in text
    assert text.count("data: {") >= TOKENS  # every token arrived, none cut off
    assert (routing["dispatches"], routing["disconnects"]) == (1, 0)
    assert "router stopped" in router_err.text
    assert "Traceback" not in router_err.text


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--port", "abc"], "router serve: --port must be an integer, got 'abc'"),
        (["--policy", "fastest"], "router serve: --policy must be one of round_robin, random, "),
        (
            ["--worker", "localhost:8000"],
            "router serve: --worker 'localhost:8000': worker URL 'localhost:8000' must start with http://",
        ),
        (
            ["--worker", "http://127.0.0.1:1,model=m", "--worker", "https://gpu-7:8000,model=m"],
            "router serve: --worker 'https://gpu-7:8000,model=m': worker URL 'https://gpu-7:8000': "
            "TLS to workers is not supported",
        ),
        (
            ["--worker", "http://gpü-7:8000"],
            "router serve: --worker 'http://gpü-7:8000': worker URL 'http://gpü-7:8000' must be ASCII",
        ),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
async def test_a_bad_flag_exits_2_with_a_clear_message(args: list[str], complaint: str) -> None:
    with trio.fail_after(20):
        result = await _run("serve", *args)
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert complaint in stderr
    assert "Traceback" not in stderr
    assert result.stdout == b""


async def test_a_port_already_bound_exits_3() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(20):
            result = await _run("serve", "--port", str(port))
    stderr = result.stderr.decode()
    assert result.returncode == 3
    assert f"router serve: cannot listen on 127.0.0.1:{port}: " in stderr
    assert "Traceback" not in stderr

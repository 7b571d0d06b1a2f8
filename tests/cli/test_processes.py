"""`router serve --processes N`: children sharing one port, signals passed on, port 0 refused."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from router.cli.config import Settings
from router.cli.processes import child_command, run_processes
from tests.support.fake_fleet import open_fake_fleet
from tests.support.ports import free_port
from tests.support.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_port_zero_is_refused_when_processes_would_not_share_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_processes(Settings.defaults(processes=2, port=0), []) == 2
    assert "needs an explicit --port" in capsys.readouterr().err


def test_a_child_runs_the_same_flags_as_one_process_on_a_shared_port() -> None:
    command = child_command(["--port", "9000", "--processes", "4"])
    assert command[-6:] == ["9000", "--processes", "4", "--processes", "1", "--reuse-port"]


def _kill_tree(process: trio.Process) -> None:
    """A failing test still leaves no router behind: the children run in sessions of their
    own, so killing the parent alone would orphan them."""
    if process.returncode is None:
        for child in _children(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        process.kill()


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _children(pid: int) -> list[int]:
    # Every thread's list: trio starts processes from a worker thread, whose children they are.
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return children


async def test_two_processes_serve_one_port_and_both_stop_on_one_sigterm() -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(1) as fleet:
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--port",
                str(port),
                "--worker",
                fleet[0].url,
                "--processes",
                "2",
                "--log-level",
                "warning",
                "--health-interval-s",
                "3600",
            ]
            process = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                    await wait_until(lambda: len(_children(process.pid)) >= 2)
                    children = _children(process.pid)
                    await wait_until(lambda: _accepts(port))
                    for _ in range(20):
                        # A new connection each time, so the kernel picks a process each time.
                        response = await http.post(
                            "/v1/chat/completions", json=CHAT, headers={"connection": "close"}
                        )
                        assert response.status_code == 200
                assert fleet[0].worker.routing.dispatches == 20
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
            finally:
                _kill_tree(process)
            for child in children:
                with pytest.raises(ProcessLookupError):
                    os.kill(child, 0)


async def test_a_sigterm_while_the_processes_start_stops_them_all_cleanly() -> None:
    # The children have no signal handler until trio runs in them, so the forwarded
    # SIGTERM ends them by its default action; nothing listened yet, nothing was cut.
    with trio.fail_after(30):
        command = [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--port",
            str(free_port()),
            "--worker",
            "http://127.0.0.1:9,model=m",
            "--processes",
            "2",
            "--log-level",
            "warning",
        ]
        process = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL)
        try:
            await wait_until(lambda: len(_children(process.pid)) >= 2, interval_s=0.001)
            children = _children(process.pid)
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            _kill_tree(process)
    for child in children:
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)


async def test_sighup_reaches_every_process_and_reloads_the_keys_without_stopping_any(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("alice: key-of-alice\n")
    with trio.fail_after(30):
        async with open_fake_fleet(1) as fleet:
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--port",
                str(port),
                "--worker",
                fleet[0].url,
                "--processes",
                "2",
                "--log-level",
                "info",
                "--health-interval-s",
                "3600",
                "--api-keys-file",
                str(keys_file),
            ]
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            output = bytearray()

            async def read_output() -> None:
                assert process.stderr is not None
                async for chunk in process.stderr:
                    output.extend(chunk)

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_output)
                    # Both children listen, so both have their SIGHUP handler.
                    await wait_until(lambda: output.count(b"router listening on") == 2)
                    keys_file.write_text("bob: key-of-bob\n")
                    process.send_signal(signal.SIGHUP)
                    await wait_until(
                        lambda: output.count(b"SIGHUP: 1 client keys in force (bob)") == 2
                    )
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                        for key, expected in (("key-of-bob", 200), ("key-of-alice", 401)) * 5:
                            response = await http.post(
                                "/v1/chat/completions",
                                json=CHAT,
                                headers={"connection": "close", "authorization": f"Bearer {key}"},
                            )
                            assert response.status_code == expected
                    assert process.returncode is None and len(_children(process.pid)) == 2
                    process.send_signal(signal.SIGTERM)
                    assert await process.wait() == 0
            finally:
                _kill_tree(process)
    assert fleet[0].worker.routing.dispatches == 5

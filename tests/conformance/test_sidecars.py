"""A plane's sidecars end with its case, whatever the case did, and with the runner.

The stub plane starts a sidecar that ignores SIGTERM and forks a grandchild. Every
process of the plane carries a mark in its environment; `/proc/*/environ` says which
processes are still alive with it: the real process tree, not what the runner believes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import trio

from conformance.loader import load_cases
from conformance.runner import RunOptions, run_suite
from tests.conformance.stub_planes import MARK_VARIABLE, SidecarStubPlane

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "passes": """
        name: passes
        description: two requests, both served
        fleet: {a: {}}
        steps:
          - send: {count: 2}
            expect: {status: {200: 2}}
    """,
    "fails": """
        name: fails
        description: expects a 404 the stub never gives
        fleet: {a: {}}
        steps:
          - send: {count: 1}
            expect: {status: {404: 1}}
    """,
    "hangs": """
        name: hangs
        description: outlives the case timeout
        fleet: {a: {}}
        steps:
          - send: {count: 1}
          - wait: 60
    """,
}


def marked(mark: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose environment holds `mark`."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def write_spec(tmp_path: Path) -> Path:
    root = tmp_path / "spec"
    (root / "stub").mkdir(parents=True)
    (root / "VERSION").write_text("1\n")
    for name, text in CASES.items():
        (root / "stub" / f"{name}.yaml").write_text(textwrap.dedent(text))
    return root


class Watched(SidecarStubPlane):
    """Counts, once the plane is ready, the processes that carry its mark."""

    seen_at_ready: list[int]

    async def wait_ready(self, client, url, launch):  # type: ignore[no-untyped-def]
        await super().wait_ready(client, url, launch)
        self.seen_at_ready.append(len(marked(self.mark)))


@pytest.mark.parametrize(
    ("case_id", "verdict"),
    [("stub/passes", "pass"), ("stub/fails", "fail"), ("stub/hangs", "error")],
)
async def test_no_process_is_left_when_a_case_passes_fails_or_times_out(
    tmp_path: Path, case_id: str, verdict: str
) -> None:
    root = write_spec(tmp_path)
    [case] = [c for c in load_cases([root], root).cases if c.id == case_id]
    plane = Watched()
    plane.mark = "conformance-stub-" + uuid.uuid4().hex
    plane.seen_at_ready = []
    # The case timeout covers the start of the sidecar, the fleet and the plane too: on a
    # loaded machine that alone has taken over 4 s, and the hanging case must be seen
    # running (below) before its timeout ends it.
    with trio.fail_after(60):
        [outcome] = await run_suite([case], [plane], {}, RunOptions(jobs=1, case_timeout_s=15.0))
    assert (outcome.verdict, outcome.case_id) == (verdict, case_id), outcome
    leftovers = marked(plane.mark)
    for pid in leftovers:  # whatever a failed run left, so the test leaves nothing
        os.kill(pid, signal.SIGKILL)
    # The plane, the sidecar and its grandchild were all there while the case ran...
    assert plane.seen_at_ready and plane.seen_at_ready[0] >= 3
    # ...and none of them is now.
    assert leftovers == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_runner_stops_every_process_it_started(tmp_path: Path, signum: int) -> None:
    root = write_spec(tmp_path)
    mark = "conformance-stub-" + uuid.uuid4().hex
    # Everything the runner starts inherits the mark: fake workers, plane, sidecars.
    env = {**os.environ, MARK_VARIABLE: mark}
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conformance",
            "--spec",
            str(root),
            "run",
            "--case",
            "stub/hangs",
            "--plane",
            "tests.conformance.stub_planes:SidecarStubPlane",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60  # wall clock: a real subprocess, not trio's clock
        # runner + fake worker + plane + sidecar + grandchild
        while len(marked(mark)) < 5:
            assert runner.poll() is None, runner.communicate()[0]
            assert time.monotonic() < deadline, f"only {len(marked(mark))} marked processes came up"
            time.sleep(0.05)
        runner.send_signal(signum)
        output, _ = runner.communicate(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        leftovers = marked(mark)
        for pid in leftovers:  # whatever a failed run left, so the test leaves nothing
            os.kill(pid, signal.SIGKILL)
    assert leftovers == []
    assert runner.returncode == 130, output
    assert "interrupted" in output


class MissingSidecar(SidecarStubPlane):
    async def start_sidecars(self, sidecars, case):  # type: ignore[no-untyped-def]
        await sidecars.start(["/nonexistent/sidecar-binary"], "missing")


async def test_a_sidecar_that_cannot_start_is_an_error_of_its_case_not_a_crash(
    tmp_path: Path,
) -> None:
    root = write_spec(tmp_path)
    [case] = [c for c in load_cases([root], root).cases if c.id == "stub/passes"]
    with trio.fail_after(30):
        [outcome] = await run_suite([case], [MissingSidecar()], {}, RunOptions(jobs=1))
    assert outcome.verdict == "error"
    assert "sidecar missing could not start (/nonexistent/sidecar-binary)" in outcome.detail

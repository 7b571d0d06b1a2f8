"""What the router process tells of itself at scrape time: its build, and its tasks."""

from __future__ import annotations

import subprocess
import sys

import trio
from prometheus_client import CollectorRegistry, generate_latest

import router
import router.api.errors
from router.observability.runtime_metrics import TaskCollector, build


def _scrape() -> str:
    registry = CollectorRegistry()
    registry.register(TaskCollector())
    return generate_latest(registry).decode()


def test_the_build_is_read_from_where_the_request_path_was_loaded() -> None:
    compiled = not router.api.errors.__file__.endswith(".py")
    assert build() == ("compiled" if compiled else "pure")


async def test_build_info_and_tasks_are_on_the_page() -> None:
    page = _scrape()
    assert f'router_build_info{{build="{build()}",version="{router.__version__}"}} 1.0' in page
    tasks = [line for line in page.splitlines() if line.startswith("router_tasks ")]
    assert len(tasks) == 1 and float(tasks[0].split()[1]) >= 1
    await trio.lowlevel.checkpoint()


def test_outside_a_trio_run_the_task_count_is_left_out_not_zero() -> None:
    page = _scrape()
    assert "router_build_info{" in page
    assert "router_tasks " not in page


def test_router_version_says_the_build() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == f"router {router.__version__} ({build()})"

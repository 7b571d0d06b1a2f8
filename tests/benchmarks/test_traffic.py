"""The traffic benchmark: its judgement of each figure (pure), and one tiny run end to end
that writes a well-formed block (only the shape is checked, never a figure that depends on
the machine, but for the counts that do not: nothing of a disconnected client dispatched,
no fallback unmarked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench.traffic_report import (
    END,
    START,
    Canary,
    Disconnects,
    Fallback,
    Flood,
    Latencies,
    TrafficResults,
    binomial_bounds,
    markdown,
    percentile,
    write_block,
)

REPO = Path(__file__).resolve().parents[2]


def test_binomial_bounds_of_a_5_percent_canary_over_10000() -> None:
    # Mean 500, deviation 21.8: 3.29 deviations each side.
    assert binomial_bounds(10_000, 0.05) == (428, 572)
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0


def _results(light_p99: float, canary: int, dispatched: int) -> TrafficResults:
    flood = Flood(1000, 0, 400.0, 600.0)
    return TrafficResults(
        quick=False,
        date="2026-12-05 00:00 UTC",
        command="python -m bench --traffic",
        seconds_per_run=20,
        load=(1.0, 1.5),
        slots=8,
        service_ms=50.0,
        flood_clients=80,
        idle=Latencies("light tenant", (55.0, 60.0), 0),
        fair=Latencies("light tenant", (70.0, light_p99), 0, flood),
        fifo=Latencies("light tenant", (500.0, 520.0), 0, flood),
        high=Latencies("high priority", (58.0, 62.0), 0, flood),
        high_fifo=Latencies("high priority", (500.0, 540.0), 0, flood),
        disconnects=Disconnects(1000, 1000, 1000, dispatched, 0, 8, 0.1),
        canary=Canary(10_000, 0.05, canary, 10_000 - canary, 0, 10_000),
        fallback=Fallback(900, 0, 600, 600, 600, 6.7, 20),
    )


def test_each_target_is_judged_and_a_miss_says_so() -> None:
    block = markdown(_results(light_p99=110.0, canary=503, dispatched=0))
    assert block.startswith(START) and block.rstrip().endswith(END)
    assert block.count("| met |") == 5
    assert "| 110.0 ms vs 60.0 ms idle (1.83x) | met |" in block
    missed = markdown(_results(light_p99=130.0, canary=600, dispatched=1))
    assert missed.count("MISSED") == 3


def test_the_block_replaces_its_own_and_keeps_the_page(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text(
        f"# Perf\n\nBy hand.\n\n{START}\nfigures of before\n{END}\n\n## After\n\nAlso by hand.\n"
    )
    write_block(page, markdown(_results(100.0, 500, 0)))
    text = page.read_text()
    assert "figures of before" not in text
    assert text.startswith("# Perf\n\nBy hand.\n\n")
    assert text.endswith("\n## After\n\nAlso by hand.\n")


def test_a_tiny_run_writes_the_block_with_nothing_of_the_leavers_dispatched(
    tmp_path: Path,
) -> None:
    out = tmp_path / "perf.md"
    out.write_text("# Perf\n")
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "--traffic", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr + completed.stdout
    text = out.read_text()
    assert text.startswith("# Perf\n\n" + START)
    assert re.search(
        r"\| 200 queued clients that disconnect: .* \| queue at 200; then 0 dispatched, 0 slots held",
        text,
    )
    assert re.search(r"\| fallback under a down fleet: .* [\d,]+ requests, 0 failed", text)

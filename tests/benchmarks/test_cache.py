"""The cache benchmark's pure parts: the workload is deterministic, the report keeps the
rest of the document, and a missed target says so."""

from __future__ import annotations

from pathlib import Path

from bench.cache import CacheRun
from bench.cache_micro import MicroResult
from bench.cache_report import END, START, markdown, write_block
from bench.cache_workload import Workload, percentile


def run(name: str, hit: float, ttft: float) -> CacheRun:
    return CacheRun(
        name, 100, 0, 10_000, int(10_000 * hit), ttft, ttft * 3, (30, 20, 25, 25), 800.0, 5.0, 900.0
    )


MICRO = MicroResult(2000, 30.0, 0.3, 1_000_000, 100_000, 2**26, 2**26 - 5, 10**8, 4.0)


def test_the_workload_is_the_same_every_run_and_grows_by_whole_turns() -> None:
    a, b = Workload(), Workload()
    assert a.system_prompt() == b.system_prompt() and len(a.system_prompt()) == a.system_chars
    assert a.user_message(3, 1) == b.user_message(3, 1) != a.user_message(3, 2)
    assert a.requests == a.conversations * a.turns
    assert a.working_set_bytes() > a.conversations * a.turns * a.user_chars


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN: unknown is not zero


def test_the_report_judges_the_targets_and_keeps_the_rest_of_the_page(tmp_path: Path) -> None:
    runs = [
        run("ours round_robin", 0.6, 80.0),
        run("ours cache_aware", 0.85, 20.0),
        run("smg cache_aware", 0.9, 18.0),
    ]
    block = markdown(runs, MICRO, Workload(), 4000, 100.0, quick=False)
    assert "| ours cache_aware hit rate >= smg cache_aware's | 85.0% vs 90.0% | MISSED |" in block
    assert "(4.0x) | met |" in block
    assert (
        "| ours cache_aware | 85.0% | 1.5 |" in block
    )  # 1,500 uncached tokens x 100 us / 100 requests
    page = tmp_path / "performance.md"
    page.write_text(f"# Perf\n\nby hand\n\n{START}\nOLD-FIGURES\n{END}\n\n## After\n")
    write_block(page, block)
    text = page.read_text()
    assert text.startswith("# Perf\n\nby hand\n\n") and text.endswith("\n\n## After\n")
    assert text.count(START) == 1 and "OLD-FIGURES" not in text
    fresh = tmp_path / "new.md"
    fresh.write_text("# Other\n")
    write_block(fresh, block)
    assert fresh.read_text().startswith("# Other\n\n" + START)

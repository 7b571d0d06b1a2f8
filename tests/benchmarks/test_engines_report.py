"""The real-engine benchmark's pure parts: what a hop adds is judged against the direct
run of the same round, a hop's CPU is its own, and the block leaves the page around it."""

from __future__ import annotations

from pathlib import Path

from bench.engines import END, START, results_markdown, summarize
from bench.report import write_doc
from bench.run import Measurement

CASE = "engine-unary-c1"


def measurement(contender: str, round_: int, p50_ms: float, cpu_s: float) -> Measurement:
    return Measurement(
        contender=contender,
        case=CASE,
        round=round_,
        requests=100,
        duration_s=20.0,
        errors=0,
        p50_ms=p50_ms,
        p99_ms=p50_ms * 2,
        cpu_s=cpu_s,
        fleet_cpu_s=30.0,
        wrk_cpu_s=0.1,
        peak_rss_kb=1024,
    )


def test_added_latency_is_per_round_against_direct_and_hop_cpu_is_the_hops() -> None:
    runs = [
        measurement("direct", 0, 100.0, 30.0),
        measurement("ours", 0, 103.0, 0.2),
        measurement("direct", 1, 200.0, 30.0),  # a slow round for everyone
        measurement("ours", 1, 230.0, 0.4),
        measurement("direct", 2, 150.0, 30.0),
        measurement("ours", 2, 152.0, 0.3),
    ]
    rows = {row.contender: row for row in summarize(runs)}
    # The median of the rounds' differences (3, 30, 2), not the difference of the two
    # medians (152 - 150 = 2), which pairs one round's hop with another round's engine.
    assert rows["ours"].added_p50_ms == 3.0
    assert rows["ours"].hop_cpu_us == (0.2 + 0.4 + 0.3) / 300 * 1e6
    assert rows["direct"].added_p50_ms is None and rows["direct"].hop_cpu_us is None
    assert rows["ours"].engine_cpu_us == 30.0 * 3 / 300 * 1e6


def test_the_engine_block_replaces_only_itself(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nbefore\n\n" + START + "\nold\n" + END + "\n\nafter\n")
    rows = summarize([measurement("direct", 0, 100.0, 30.0), measurement("ours", 0, 104.0, 0.2)])
    header = {
        "date": "today",
        "command": "python -m bench --engines",
        "rounds": "1",
        "duration": "20",
        "cpus": "2",
        "cpu_model": "cpu",
        "load_at_start": "0.1",
        "engine": "one engine",
    }
    write_doc(page, results_markdown(rows, header), start=START, end=END)
    text = page.read_text()
    assert "before" in text and "after" in text and "old" not in text
    assert "| unary, c=1 | ours | 5.0 | 104.00 | 208.00 | 4.00 | 2,000 |" in text

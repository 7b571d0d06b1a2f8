"""The block a run on the vLLM fleet writes: resume capture on against off and smg, in its
own place of the page, leaving the default fleet's results as they were."""

from __future__ import annotations

from pathlib import Path

from bench.plan import STREAM_EVENTS
from bench.report import RESUME_END, RESUME_START, results_markdown, write_doc
from bench.run import Measurement, Session

HEADER = {
    "command": "python -m bench --fleet-engine vllm",
    "date": "2026-12-05 13:00 UTC",
    "cpus": "2",
    "cpu_model": "cpu",
    "kernel": "6",
    "load_at_start": "1.0",
    "python": "3.11",
    "trio": "0.30",
    "h11": "0.16",
    "hypercorn": "0.17",
    "smg": "1.13.0",
    "wrk": "wrk 4.2",
    "rounds": "1",
    "duration": "2",
    "fleet": "2 (vllm)",
}


def measured(contender: str, case: str, cpu_s: float) -> Measurement:
    return Measurement(contender, case, 0, 1000, 2.0, 0, 1.0, 2.0, cpu_s, 0.5, 0.5, 50_000)


def test_the_resume_block_goes_in_its_own_place_with_the_cost_per_event(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text(
        "# Perf\n\n<!-- bench:results:start -->\nthe default fleet's figures\n"
        "<!-- bench:results:end -->\n\nBy hand.\n"
    )
    session = Session(
        measurements=[
            measured("ours-noresume", "stream-c32", 0.5),
            measured("ours-resume", "stream-c32", 0.6),
            measured("smg", "stream-c32", 0.4),
        ]
    )
    block = results_markdown(session, HEADER, None, resume=True)
    write_doc(page, block, start=RESUME_START, end=RESUME_END)
    write_doc(page, block.replace("0.60", "0.61"), start=RESUME_START, end=RESUME_END)

    text = page.read_text()
    assert "the default fleet's figures" in text and "By hand." in text
    assert text.count(RESUME_START) == text.count(RESUME_END) == 1
    assert "### Targets" not in text
    per_event = {
        name: f"{cpu / (1000 * STREAM_EVENTS) * 1e6:.1f} us"
        for name, cpu in (("ours-resume", 0.6), ("ours-noresume", 0.5), ("smg", 0.4))
    }
    assert (
        "CPU per relayed SSE event, stream-c32: "
        f"ours-resume {per_event['ours-resume']}, ours-noresume {per_event['ours-noresume']}, "
        f"smg {per_event['smg']}."
    ) in text
    assert "| ours-resume / ours-noresume | 0.83 |" in text

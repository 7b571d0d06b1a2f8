"""The cache benchmark's section of docs/performance.md (and docs/policies.md): the table
per contender, the targets, and the micro-benchmark."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cache_micro import MicroResult
from bench.cache_workload import Workload

if TYPE_CHECKING:
    from bench.cache import CacheRun

START = "<!-- bench:cache:start -->"
END = "<!-- bench:cache:end -->"


def markdown(
    runs: Sequence[CacheRun],
    micro: MicroResult,
    workload: Workload,
    cache_tokens: int,
    prefill_us: float,
    quick: bool,
) -> str:
    by_name = {run.contender: run for run in runs}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = [START, "## Cache-aware routing (`python -m bench --cache`)", ""]
    out.append(
        f"Generated on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC{' (--quick)' if quick else ''}; "
        f"{os.cpu_count()} CPUs, load average at the end {load}. Workload: {workload.conversations} "
        f"conversations of {workload.turns} turns ({workload.requests} streamed chat requests), "
        f"{workload.users} clients at once, a shared {workload.system_chars}-character system prompt, "
        f"{workload.user_chars}-character user messages, {workload.answer_tokens}-token answers; each "
        "turn sends the whole conversation so far. Fleet: 4 fake workers, each with a prefix cache "
        f"of {cache_tokens:,} tokens (the fleet holds about a third of the "
        f"~{workload.working_set_bytes() // 4:,} distinct prompt tokens), prefill "
        f"{prefill_us:g} us per uncached token. Caches flushed and counters zeroed before each contender."
    )
    out.append("")
    out.append(
        "Hit rates, and the prefill time they imply (uncached tokens times the per-token cost, "
        "averaged per request), come from the workers' own counters and do not depend on the "
        "machine's load. Time to first token is the client's (send to first content chunk) and, "
        "like CPU, was taken on a machine shared with other work: read those as rough."
    )
    out += [
        "",
        "| contender | fleet cache hit rate | prefill ms per request (from the counters) | TTFT p50 ms "
        "| TTFT p99 ms | requests per worker (max/min) | router CPU per request (us) | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in runs:
        spread = f"{max(run.per_worker)}/{min(run.per_worker)}" if run.per_worker else "-"
        out.append(
            f"| {run.contender} | {run.hit_rate:.1%} | {run.prefill_ms:.1f} | {run.ttft_p50_ms:.1f} | {run.ttft_p99_ms:.1f} "
            f"| {spread} | {run.cpu_us_per_request:.0f} | {run.errors} |"
        )
    out += ["", "### Targets", "", "| target | this run | verdict |", "|---|---|---|"]
    for target, measured, ok in _targets(by_name, micro):
        out.append(
            f"| {target} | {measured} | {'met' if ok else 'MISSED' if ok is not None else 'not measured'} |"
        )
    out += [
        "",
        "### Micro-benchmark (in-process, CPU time)",
        "",
        f"- Pick-and-insert of a 4 KiB prompt (half extend a shared prefix, half are new) against a "
        f"tree kept full at its budget of 10^6 characters ({micro.tree_chars:,} after the run; the "
        f"evictions that keep it there are included), 4 workers: **{micro.cache_aware_us:.1f} us** per "
        f"request, over {micro.picks:,} picks; `round_robin`'s pick: {micro.round_robin_us:.2f} us.",
        f"- {micro.distinct_prompts:,} distinct 4 KiB prompts into a tree with the default budget "
        f"(`--max-tree-size` {micro.budget_chars:,} characters): at most {micro.peak_chars:,} "
        f"characters held after any insert, {micro.evicted_chars:,} evicted, "
        f"{micro.fill_s:.1f} s of CPU in all.",
        "",
        END,
    ]
    return "\n".join(out) + "\n"


def _targets(runs: dict[str, CacheRun], micro: MicroResult) -> list[tuple[str, str, bool | None]]:
    ours, smg, rr = (
        runs.get("ours cache_aware"),
        runs.get("smg cache_aware"),
        runs.get("ours round_robin"),
    )
    rows: list[tuple[str, str, bool | None]] = []
    if ours and smg:
        rows.append(
            (
                "ours cache_aware hit rate >= smg cache_aware's",
                f"{ours.hit_rate:.1%} vs {smg.hit_rate:.1%}",
                ours.hit_rate >= smg.hit_rate,
            )
        )
    if ours and rr:
        rows.append(
            (
                "ours cache_aware TTFT p50 at least 2x lower than ours round_robin",
                f"{ours.ttft_p50_ms:.1f} ms vs {rr.ttft_p50_ms:.1f} ms ({rr.ttft_p50_ms / ours.ttft_p50_ms:.1f}x)",
                rr.ttft_p50_ms >= 2 * ours.ttft_p50_ms,
            )
        )
        if ours.cpu_4k_us_per_request is not None and rr.cpu_4k_us_per_request is not None:
            ratio = ours.cpu_4k_us_per_request / rr.cpu_4k_us_per_request
            rows.append(
                (
                    "router CPU per 4 KiB request, tree >= 10^6 characters: cache_aware <= 1.5x round_robin",
                    f"{ours.cpu_4k_us_per_request:.0f} vs {rr.cpu_4k_us_per_request:.0f} us ({ratio:.2f}x)",
                    ratio <= 1.5,
                )
            )
    rows.append(
        (
            "tree memory under --max-tree-size after 10^5 distinct prompts",
            f"{micro.peak_chars:,} <= {micro.budget_chars:,} characters ({micro.distinct_prompts:,} prompts)",
            micro.peak_chars <= micro.budget_chars if micro.distinct_prompts >= 100_000 else None,
        )
    )
    return rows


def write_block(path: Path, block: str) -> None:
    """Replace the cache section of `path` (appended when it has none), keeping the rest."""
    text = path.read_text() if path.exists() else ""
    if START in text and END in text:
        head, _, rest = text.partition(START)
        _, _, tail = rest.partition(END)
        text = head + block.rstrip("\n") + tail
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    path.write_text(text)

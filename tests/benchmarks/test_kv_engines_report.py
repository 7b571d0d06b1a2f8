"""The kv_aware engine benchmark's pure parts: the hit rate is the engines' counters'
delta summed over the fleet, a missing counter is an error and not a zero, and the block
shows every contender, with errors where a run had them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import kv_engines
from bench.cache_workload import ClientStats
from bench.kv_engines_report import (
    END,
    LOAD_READS,
    START,
    FleetCounters,
    KvRun,
    MetricsError,
    RestartRun,
    Window,
    kv_summary,
    labelled_series,
    markdown,
    markers,
    place_block,
    prompt_facts,
    replica_verdicts,
)
from bench.report import write_doc


def page(hits: float, queries: float, stop: float, length: float) -> str:
    """An engine's /metrics as vLLM 0.32 writes it (the parts the bench reads)."""
    return f"""\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{engine="0",model_name="tiny"}} 1.79e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{{engine="0",model_name="tiny"}} 999.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="tiny"}} {stop}
vllm:request_success_total{{engine="0",finished_reason="length",model_name="tiny"}} {length}
"""


def test_the_hit_rate_is_the_delta_of_the_counters_summed_over_the_engines() -> None:
    before = FleetCounters.parse(
        [("a", page(100.0, 400.0, 1.0, 2.0)), ("b", page(0.0, 0.0, 0.0, 0.0))]
    )
    after = FleetCounters.parse(
        [("a", page(400.0, 1000.0, 1.0, 12.0)), ("b", page(500.0, 1000.0, 3.0, 7.0))]
    )
    window = Window.between(before, after)
    # (300 + 500) hits over (600 + 1000) queries; the external cache is another counter.
    assert (window.hit_tokens, window.queried_tokens) == (800, 1600)
    assert window.hit_rate == 0.5
    # Finished requests per engine, every finished_reason counted.
    assert window.per_engine == (10, 10)


def test_a_missing_counter_is_an_error_not_a_zero() -> None:
    without_hits = "\n".join(
        line for line in page(1.0, 2.0, 0.0, 0.0).splitlines() if "prefix_cache_hits" not in line
    )
    with pytest.raises(MetricsError, match=r"http://b: /metrics has no vllm:prefix_cache_hits"):
        FleetCounters.parse([("http://a", page(1.0, 2.0, 0.0, 0.0)), ("http://b", without_hits)])


def test_nothing_queried_is_no_hit_rate() -> None:
    same = FleetCounters(5.0, 10.0, (1.0,))
    assert Window.between(same, same).hit_rate is None


def test_blocks_are_told_apart_by_what_comes_before_them() -> None:
    shared = list(range(64))
    facts = prompt_facts([shared + [1] * 40, shared + [2] * 40, list(range(100, 132))], 32)
    # 2 shared, 1 more each for the two conversations, 1 for the third prompt.
    assert facts == {"longest_prompt_tokens": 104, "distinct_blocks": 5}


def run(scenario: str, contender: str, hits: int, errors: int = 0) -> KvRun:
    stats = ClientStats(ttft_s=[0.1, 0.2, 0.3], errors=errors, requests=3 + errors)
    return KvRun.of(scenario, contender, stats, Window(hits, 1000, (1, 1, 1)), 12.0, {})


HEADER = {
    "date": "today",
    "command": "python -m bench --kv-engines",
    "cpus": "2",
    "cpu_model": "cpu",
    "load_at_start": "1.00",
    "wall": "20.0 min",
    "fleet": "3 engines.",
    "workload": "24 conversations.",
    "scenarios": "evicting and roomy.",
}
CONTENDERS = ("ours kv_aware", "ours cache_aware", "ours round_robin", "smg cache_aware")


def test_the_block_shows_every_contender_and_the_errors_of_a_run(tmp_path: Path) -> None:
    runs = [run("evicting", name, 500 - 50 * i) for i, name in enumerate(CONTENDERS)]
    runs += [run("roomy", name, 800) for name in CONTENDERS[:3]]
    runs.append(run("roomy", "smg cache_aware", 700, errors=4))
    series = {"router_kv_events_subscriptions": 3.0, "router_kv_aware_predictions_total": 140.0}
    restart = RestartRun(
        scenario="evicting",
        contender="ours kv_aware",
        requests=144,
        errors=0,
        window_requests=50,
        before=Window(300, 1000, (1, 1, 1)),
        after=Window(600, 1000, (20, 15, 15)),
        errors_after=0,
        restart_s=4.2,
        router_kv=series,
    )
    block = markdown(runs, [restart], HEADER, "evicting", "roomy")
    rows = [line for line in block.splitlines() if line.startswith(("| evicting", "| roomy"))]
    for scenario in ("evicting", "roomy"):
        for name in CONTENDERS:
            assert any(row.startswith(f"| {scenario} | {name} |") for row in rows), name
    # The run with errors carries them in its hit-rate cell, not a bare 70.0%.
    assert "| **70.0% (4 errors)** |" in block
    # The restart's windows either side; the target judged per scenario.
    assert (
        "| evicting | ours kv_aware | 144 | 0 | 50 | 30.0% | 60.0% | 20 / 15 / 15 | 4.2 |" in block
    )
    assert "- evicting: kv_aware 50.0% against cache_aware 45.0%, +5.0 points" in block
    assert "**not met**" in block.split("- roomy")[0]
    assert "- roomy: kv_aware 80.0% against cache_aware 80.0%, +0.0 points" in block
    assert "subscriptions 3" in block
    assert "applied no KV events" not in block  # no kv_aware run carried router series

    doc = tmp_path / "policies.md"
    doc.write_text("# Policies\n\nabove\n\n" + START + "\nold\n" + END + "\n\nbelow\n")
    write_doc(doc, block, start=START, end=END)
    text = doc.read_text()
    assert text.startswith("# Policies\n\nabove\n\n" + START)
    assert text.endswith(END + "\n\nbelow\n") and "old" not in text


def test_a_kv_aware_run_whose_router_applied_no_event_says_so() -> None:
    dead = {"router_kv_events_subscriptions": 3.0, "router_kv_events_batches_total": 0.0}
    stats = ClientStats(ttft_s=[0.1], requests=1)
    kv = KvRun.of("evicting", "ours kv_aware", stats, Window(500, 1000, (1,)), 1.0, dead)
    block = markdown(
        [kv, run("evicting", "ours cache_aware", 500)], [], HEADER, "evicting", "roomy"
    )
    assert "**the router applied no KV events**" in block


def _run(contender: str, rate: float, p99: float = 1000.0, scenario: str = "evicting") -> KvRun:
    window = Window(hit_tokens=round(rate * 1000), queried_tokens=1000, per_engine=(1, 1, 1))
    return KvRun(scenario, contender, 144, 0, window, 100.0, p99, 60.0)


def test_several_routers_are_judged_by_the_median_of_their_runs_against_one() -> None:
    runs = [
        _run("ours kv_aware", 0.79, 4000),
        _run("ours kv_aware", 0.78, 4600),
        _run("ours kv_aware (--processes 2)", 0.70, 9500),  # one bad run of three
        _run("ours kv_aware (--processes 2)", 0.775, 5000),
        _run("ours kv_aware (--processes 2)", 0.78, 5200),
        _run("ours kv_aware (2 routers)", 0.74, 4000),
        _run("ours round_robin", 0.50),
        _run("ours kv_aware (engine /tokenize)", 0.78),
    ]
    lines = replica_verdicts(runs, "evicting", "roomy")
    text = "\n".join(lines)
    assert (
        "- evicting: ours kv_aware (--processes 2) 77.5% against ours kv_aware 78.5%, "
        "-1.0 points (3 and 2 runs); target within 2 points of one process: met"
    ) in lines
    assert "ours kv_aware (2 routers) 74.0% against ours kv_aware 78.5%, -4.5 points" in text
    assert "within 2 points of one process: **not met**" in text
    # TTFT p99: the median 5,200 ms against 4,300 ms.
    assert "TTFT p99 5,200 ms against 4,300 ms, 1.21x; target at most 1.25x: met" in text
    assert (
        "- evicting: ours kv_aware (engine /tokenize) 78.0% against ours round_robin 50.0%, "
        "+28.0 points; target at least 15 points above round robin: met"
    ) in lines
    assert not any("roomy" in line for line in lines)  # no roomy runs: nothing judged


def test_every_contender_logs_to_a_file_in_the_work_directory() -> None:
    names = [c.name for group in kv_engines.GROUPS.values() for c in group]
    assert (
        kv_engines.log_name("ours kv_aware (engine /tokenize)") == "ours-kv_aware-engine-tokenize"
    )
    for name in names:
        assert "/" not in kv_engines.log_name(name)
    assert len({kv_engines.log_name(name) for name in names}) == len(set(names))


def test_reading_the_engines_load_is_judged_against_the_same_contender_counting_its_own() -> None:
    runs = [
        _run("ours kv_aware", 0.79),
        _run("ours kv_aware (own count)", 0.80),
        _run("ours kv_aware (--processes 2)", 0.76),
        _run("ours kv_aware (--processes 2, own count)", 0.79),
    ]
    lines = replica_verdicts(runs, "evicting", "roomy")
    assert (
        "- evicting: ours kv_aware 79.0% against ours kv_aware (own count) 80.0%, -1.0 points; "
        "target no more than 2 points under its own count: met"
    ) in lines
    assert (
        "- evicting: ours kv_aware (--processes 2) 76.0% against "
        "ours kv_aware (--processes 2, own count) 79.0%, -3.0 points; "
        "target no more than 2 points under its own count: **not met**"
    ) in lines


def test_a_named_block_goes_after_the_main_table_and_a_second_run_replaces_only_itself() -> None:
    start, end = markers("repeat3")
    page = "# Policies\n\n" + START + "\nmain\n" + END + "\n\nprose below\n"
    first = place_block(page, start + "\nrun one\n" + end + "\n", start, end)
    assert first == (
        "# Policies\n\n"
        + START
        + "\nmain\n"
        + END
        + "\n\n"
        + start
        + "\nrun one\n"
        + end
        + "\n\nprose below\n"
    )
    second = place_block(first, start + "\nrun two\n" + end + "\n", start, end)
    assert "run one" not in second and "run two" in second and "main" in second
    assert second.count(start) == 1 and second.endswith("\n\nprose below\n")
    # The main block itself, as before.
    assert "new" in place_block(page, START + "\nnew\n" + END, START, END)
    assert markers(None) == (START, END)
    for bad in ("", "Upper", "a b", "../x", "x" * 41):
        with pytest.raises(ValueError):
            markers(bad)


def test_a_run_that_stopped_part_way_keeps_what_it_measured_and_says_so() -> None:
    header = {**HEADER, "partial": "BenchError: engine0-roomy exited with status 1"}
    block = markdown([_run("ours kv_aware", 0.78)], [], header, "evicting", "roomy")
    assert "| evicting | ours kv_aware | 144 | 0 | 78.0% |" in block
    assert "**Partial run**: it stopped at `BenchError: engine0-roomy exited" in block
    assert "Partial" not in markdown([_run("ours kv_aware", 0.78)], [], HEADER, "e", "r")


def test_the_routers_view_names_how_it_read_the_engines_load() -> None:
    text = (
        "# TYPE router_engine_load_reads_total counter\n"
        'router_engine_load_reads_total{source="server_load",outcome="ok"} 410\n'
        'router_engine_load_reads_total{source="server_load",outcome="unproven"} 0\n'
        'router_engine_load_reads_total{source="metrics",outcome="ok"} 82\n'
    )
    series = labelled_series(text, LOAD_READS)
    line = kv_summary({"router_kv_events_subscriptions": 3.0, **series})
    assert "engine_load_reads_total{outcome=ok,source=server_load} 410" in line
    assert "engine_load_reads_total{outcome=ok,source=metrics} 82" in line
    assert "unproven" not in line  # a zero says nothing

"""The figures of `python -m bench --kv-engines` from the engines' own counters, and the
block of docs/policies.md they go into.

The hit rate is the engines' word, not the router's: the delta, over a run, of vLLM's
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total` (prompt tokens
found in the prefix cache, over prompt tokens looked up), each summed over the engines.
A counter missing from an engine's `/metrics` is an error, never a zero: a zero would
read as a miss the router caused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from bench.cache_workload import ClientStats, Workload, percentile

START = "<!-- bench:kv-engines:start -->"
END = "<!-- bench:kv-engines:end -->"
BLOCK_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SUCCESSES = "vllm:request_success_total"
TARGET_POINTS = 10.0
"""Where engines evict, kv_aware's hit rate should beat cache_aware's by this many points."""
NO_WORSE_POINTS = 1.0
"""Where they do not, kv_aware may trail cache_aware by at most this (run-to-run noise)."""


class MetricsError(RuntimeError):
    """An engine's /metrics lacks a counter the figures need."""


def markers(block: str | None) -> tuple[str, str]:
    """The start and end markers of the results block: the main one, or the one named
    `block` (`--kv-block`, a run kept beside the main table rather than over it)."""
    if block is None:
        return START, END
    if not BLOCK_NAME.fullmatch(block):
        raise ValueError(f"{block!r}: lower-case letters, digits and dashes, at most 40")
    return f"<!-- bench:kv-engines-{block}:start -->", f"<!-- bench:kv-engines-{block}:end -->"


def place_block(text: str, block: str, start: str, end: str) -> str:
    """`text` with `block` between `start` and `end`: over the old one if there is one,
    else right after the main block (so a named run sits beside the table it adds to),
    else at the end."""
    if start in text and end in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        return head + block.rstrip("\n") + tail
    if END in text:
        head, _, tail = text.partition(END)
        return head + END + "\n\n" + block.rstrip("\n") + tail
    return text.rstrip("\n") + "\n\n" + block


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, summed over its labels, by sample name."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def counter(text: str, name: str, where: str) -> float:
    """The counter `name` of one /metrics page, summed over its labels."""
    value = samples(text).get(name)
    if value is None:
        raise MetricsError(f"{where}: /metrics has no {name}")
    return value


@dataclass(frozen=True, slots=True)
class FleetCounters:
    """The fleet's counters at one moment: prefix-cache tokens summed over the engines,
    finished requests per engine."""

    hits: float
    queries: float
    successes: tuple[float, ...]

    @classmethod
    def parse(cls, pages: Sequence[tuple[str, str]]) -> FleetCounters:
        """From (engine URL, /metrics text) pairs, in the fleet's order."""
        hits = queries = 0.0
        successes = []
        for where, text in pages:
            hits += counter(text, HITS, where)
            queries += counter(text, QUERIES, where)
            successes.append(counter(text, SUCCESSES, where))
        return cls(hits, queries, tuple(successes))


@dataclass(frozen=True, slots=True)
class Window:
    """What the engines counted between two readings."""

    hit_tokens: int
    queried_tokens: int
    per_engine: tuple[int, ...]

    @classmethod
    def between(cls, before: FleetCounters, after: FleetCounters) -> Window:
        return cls(
            hit_tokens=round(after.hits - before.hits),
            queried_tokens=round(after.queries - before.queries),
            per_engine=tuple(
                round(a - b) for a, b in zip(after.successes, before.successes, strict=True)
            ),
        )

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None


def prompt_facts(prompts: Sequence[Sequence[int]], block_size: int) -> dict[str, float]:
    """The longest prompt and the distinct full blocks over `prompts` (a block is told
    apart by everything before it, as the engines' chained block hashes are)."""
    blocks = {
        tuple(prompt[:end])
        for prompt in prompts
        for end in range(block_size, len(prompt) + 1, block_size)
    }
    return {"longest_prompt_tokens": max(map(len, prompts)), "distinct_blocks": len(blocks)}


@dataclass(frozen=True, slots=True)
class FleetShape:
    """What every engine of the run was started with, for the text above the table."""

    engines: int
    block_size: int
    max_model_len: int
    evicting_blocks: int
    cache_aware_flags: tuple[str, ...]
    model: str


def describe(
    shape: FleetShape, workload: Workload, facts: Mapping[str, float], wall_s: float
) -> dict[str, str]:
    """The header's sentences on the fleet, the workload and the scenarios."""
    held = shape.engines * shape.evicting_blocks
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "wall": f"{wall_s / 60:.1f} min",
        "fleet": f"{shape.engines} vLLM engines (CPU build, model `{shape.model}`), each "
        f"`--block-size {shape.block_size} --enable-prefix-caching --max-model-len "
        f"{shape.max_model_len}`, KV events over ZMQ with a replay socket, temperature 0.",
        "workload": f"Workload: {workload.conversations} conversations of {workload.turns} "
        f"turns ({workload.requests} streamed chat requests), {workload.users} clients at "
        f"once, a shared {workload.system_chars}-character system prompt, "
        f"{workload.user_chars}-character user messages, {workload.answer_tokens}-token "
        f"answers: {facts['distinct_blocks']:.0f} distinct {shape.block_size}-token blocks, "
        f"the longest prompt {facts['longest_prompt_tokens']:.0f} tokens "
        f"({facts['chars_per_token']:.2f} characters per token, the engine's `/tokenize`).",
        "scenarios": f"Scenarios: evicting (`--num-gpu-blocks-override "
        f"{shape.evicting_blocks}`: the fleet holds {held} blocks, "
        f"{held / facts['distinct_blocks']:.0%} of the workload's) and roomy (the 1 GiB "
        f"default). cache_aware runs with `{' '.join(shape.cache_aware_flags)}` on both "
        f"planes, kv_aware with `--kv-tokenizer` the model's directory.",
    }


@dataclass(frozen=True, slots=True)
class KvRun:
    """One contender playing the whole workload in one scenario."""

    scenario: str
    contender: str
    requests: int
    errors: int
    window: Window
    ttft_p50_ms: float
    ttft_p99_ms: float
    wall_s: float
    router_kv: Mapping[str, float] = field(default_factory=dict)
    """The router's `router_kv_*` series after the run (ours kv_aware only; one process's)."""

    @classmethod
    def of(
        cls,
        scenario: str,
        contender: str,
        stats: ClientStats,
        window: Window,
        wall_s: float,
        router_kv: Mapping[str, float],
    ) -> KvRun:
        return cls(
            scenario=scenario,
            contender=contender,
            requests=stats.requests,
            errors=stats.errors,
            window=window,
            ttft_p50_ms=percentile(stats.ttft_s, 0.5) * 1000,
            ttft_p99_ms=percentile(stats.ttft_s, 0.99) * 1000,
            wall_s=wall_s,
            router_kv=router_kv,
        )

    @property
    def hit_rate(self) -> float | None:
        return self.window.hit_rate

    def summary(self) -> str:
        line = (
            f"  hit rate {hit_cell(self.hit_rate, self.errors)}, errors {self.errors}, TTFT "
            f"p50 {self.ttft_p50_ms:.0f} ms p99 {self.ttft_p99_ms:.0f} ms, per engine "
            f"{self.window.per_engine}, {self.wall_s:.0f} s"
        )
        view = kv_summary(self.router_kv, self.window.hit_tokens)
        return line + (f"\n  router: {view}" if view else "")


@dataclass(frozen=True, slots=True)
class RestartRun:
    """A run with the router restarted mid-workload: the windows either side of it."""

    scenario: str
    contender: str
    requests: int
    errors: int
    window_requests: int
    before: Window
    after: Window
    errors_after: int
    restart_s: float
    router_kv: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        scenario: str,
        contender: str,
        stats: ClientStats,
        window_requests: int,
        marks: Sequence[tuple[FleetCounters, int]],
        restart_s: float,
        router_kv: Mapping[str, float],
    ) -> RestartRun:
        """From the readings (counters, client errors so far) at the window's start, the
        restart and the window's end."""
        (first, _), (middle, errors_before), (last, errors_end) = marks
        return cls(
            scenario=scenario,
            contender=contender,
            requests=stats.requests,
            errors=stats.errors,
            window_requests=window_requests,
            before=Window.between(first, middle),
            after=Window.between(middle, last),
            errors_after=errors_end - errors_before,
            restart_s=restart_s,
            router_kv=router_kv,
        )

    def summary(self) -> str:
        line = (
            f"  hit rate {_rate(self.before.hit_rate)} before, "
            f"{hit_cell(self.after.hit_rate, self.errors_after)} after (per engine "
            f"{self.after.per_engine}), errors {self.errors}, restart {self.restart_s:.1f} s"
        )
        view = kv_summary(self.router_kv)
        return line + (f"\n  router: {view}" if view else "")


def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1%}"


def hit_cell(rate: float | None, errors: int) -> str:
    """A hit rate, flagged when the run had errors so it is not read as a clean figure."""
    return _rate(rate) if not errors else f"**{_rate(rate)} ({errors} errors)**"


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def replica_verdicts(runs: Sequence[KvRun], evicting: str, roomy: str) -> list[str]:
    """Several routers against one, and kv_aware without `--kv-tokenizer`, by the median
    of each contender's runs (a contender played several times, `--kv-repeat`)."""
    rates: dict[tuple[str, str], list[float]] = {}
    p99s: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        if run.hit_rate is not None and not run.errors:
            rates.setdefault((run.scenario, run.contender), []).append(run.hit_rate)
            p99s.setdefault((run.scenario, run.contender), []).append(run.ttft_p99_ms)
    lines = []

    def compare(scenario: str, name: str, base: str, points: float, what: str) -> None:
        got, ref = rates.get((scenario, name)), rates.get((scenario, base))
        if not got or not ref:
            return
        delta = (_median(got) - _median(ref)) * 100
        # `points` is the most it may fall short; a negative one, how far above it must be.
        verdict = "met" if delta >= -points else "**not met**"
        runs_note = f" ({len(got)} and {len(ref)} runs)" if len(got) + len(ref) > 2 else ""
        lines.append(
            f"- {scenario}: {name} {_median(got):.1%} against {base} {_median(ref):.1%}, "
            f"{delta:+.1f} points{runs_note}; target {what}: {verdict}"
        )

    for scenario in (evicting, roomy):
        for several in ("ours kv_aware (--processes 2)", "ours kv_aware (2 routers)"):
            compare(scenario, several, "ours kv_aware", 2.0, "within 2 points of one process")
            got, ref = p99s.get((scenario, several)), p99s.get((scenario, "ours kv_aware"))
            if got and ref and scenario == evicting:
                ratio = _median(got) / _median(ref)
                verdict = "met" if ratio <= 1.25 else "**not met**"
                lines.append(
                    f"- {scenario}: {several} TTFT p99 {_median(got):,.0f} ms against "
                    f"{_median(ref):,.0f} ms, {ratio:.2f}x; target at most 1.25x: {verdict}"
                )
        for alone in ("ours kv_aware (no --kv-tokenizer)", "ours kv_aware (engine /tokenize)"):
            compare(
                scenario, alone, "ours round_robin", -15.0, "at least 15 points above round robin"
            )
            compare(scenario, alone, "ours kv_aware", 2.0, "within 2 points of --kv-tokenizer")
        # What reading the engines' load changes: the same contender counting its own only.
        for own, reading in (
            ("ours kv_aware (own count)", "ours kv_aware"),
            ("ours kv_aware (--processes 2, own count)", "ours kv_aware (--processes 2)"),
        ):
            compare(scenario, reading, own, 2.0, "no more than 2 points under its own count")
    return lines


def verdicts(runs: Sequence[KvRun], evicting: str, roomy: str) -> list[str]:
    """The target, judged per scenario: kv_aware against ours cache_aware."""
    by_key = {(run.scenario, run.contender): run for run in runs}
    lines = []
    for scenario, wanted, rule in (
        (evicting, TARGET_POINTS, f"at least {TARGET_POINTS:g} points above"),
        (roomy, -NO_WORSE_POINTS, f"no worse than (within {NO_WORSE_POINTS:g} point)"),
    ):
        kv = by_key.get((scenario, "ours kv_aware"))
        ca = by_key.get((scenario, "ours cache_aware"))
        if kv is None or ca is None or kv.hit_rate is None or ca.hit_rate is None:
            lines.append(f"- {scenario}: not judged (a run is missing)")
            continue
        points = (kv.hit_rate - ca.hit_rate) * 100
        if kv.errors or ca.errors:
            verdict = "not judged: a run had errors"
        else:
            verdict = "met" if points >= wanted else "**not met**"
        if kv.router_kv and not kv.router_kv.get("router_kv_events_batches_total"):
            verdict += (
                " (**the router applied no KV events**: `router_kv_events_batches_total` 0, "
                "so kv_aware placed every request by load alone)"
            )
        lines.append(
            f"- {scenario}: kv_aware {_rate(kv.hit_rate)} against cache_aware "
            f"{_rate(ca.hit_rate)}, {points:+.1f} points; target {rule} cache_aware: {verdict}"
        )
    return lines


LOAD_READS = "router_engine_load_reads_total"


def kv_summary(series: Mapping[str, float], engine_hits: int | None = None) -> str:
    """The router's event and pick counters in one line (the ones that tell a dead stream),
    and its predicted hits over the engines' `engine_hits` when given ("" without series)."""
    if not series:
        return ""
    names = (
        "router_kv_events_subscriptions",
        "router_kv_events_batches_total",
        "router_kv_events_decode_errors_total",
        "router_kv_events_replays_total",
        "router_kv_events_replay_failures_total",
        "router_kv_events_gaps_total",
        "router_kv_events_unknown_views_total",
        "router_kv_aware_predictions_total",
        "router_kv_aware_unknown_candidates_total",
        "router_kv_aware_prompt_tokens_total",
        "router_kv_aware_predicted_hit_tokens_total",
    )
    shown = [f"{name.removeprefix('router_kv_')} {series.get(name, 0):g}" for name in names]
    for prefix in (
        "router_kv_events_received_total",
        "router_kv_index_views",
        "router_kv_aware_picks_total",
    ):
        for key, value in sorted(series.items()):
            if key.startswith(prefix + "{"):
                shown.append(f"{key.removeprefix('router_kv_')} {value:g}")
    for key, value in sorted(series.items()):
        if key.startswith("router_kv_aware_no_prediction_total{") and value:
            shown.append(f"{key.removeprefix('router_kv_')} {value:g}")
    for key, value in sorted(series.items()):
        if key.startswith(LOAD_READS + "{") and value:
            shown.append(f"{key.removeprefix('router_')} {value:g}")
    predicted = series.get("router_kv_aware_predicted_hit_tokens_total")
    if engine_hits and predicted is not None:
        shown.append(
            f"predicted hits over the engines' {engine_hits:,}: {predicted / engine_hits:.2f}"
        )
    return ", ".join(shown)


def labelled_series(text: str, prefix: str) -> dict[str, float]:
    """The samples whose name starts with `prefix`, keyed `name{labels}` (labels sorted,
    the `role` label dropped: one leg here)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix) or sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "role")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            found[key] = found.get(key, 0.0) + sample.value
    return found


def markdown(
    runs: Sequence[KvRun],
    restarts: Sequence[RestartRun],
    header: Mapping[str, str],
    evicting: str,
    roomy: str,
    *,
    block: str | None = None,
) -> str:
    """The results block (the main one, or the one named `block`): the runs, the restart
    windows, the target, the router's view."""
    start, end = markers(block)
    lines = [
        start,
        "",
        f"Measured {header['date']} with `{header['command']}` on {header['cpus']} cores "
        f"({header['cpu_model']}, load {header['load_at_start']} at the start), "
        f"{header['wall']} of wall time. {header['fleet']} {header['workload']} "
        f"{header['scenarios']}",
        "",
        "Hit rate: the engines' prefix-cache hits over queries (prompt tokens), summed over "
        "the engines, over the whole run; every engine's cache is flushed "
        "(`POST /reset_prefix_cache`) before each run. TTFT: client-side, to the first "
        "streamed content chunk. A run with errors shows them in its hit-rate cell.",
        "",
        "| scenario | contender | requests | errors | hit rate | TTFT p50 ms | TTFT p99 ms "
        "| requests per engine | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run.scenario} | {run.contender} | {run.requests} | {run.errors} "
            f"| {hit_cell(run.hit_rate, run.errors)} | {run.ttft_p50_ms:,.0f} "
            f"| {run.ttft_p99_ms:,.0f} | {' / '.join(map(str, run.window.per_engine))} "
            f"| {run.wall_s:,.0f} |"
        )
    if restarts:
        lines += [
            "",
            "Router restarted mid-run (stopped and started again on the same flags and port; "
            "the engines keep their caches): the engines' hit rate over the requests just "
            "before the restart and just after it.",
            "",
            "| scenario | contender | requests | errors | window | hit rate before "
            "| hit rate after | requests per engine after | restart s |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        for restart in restarts:
            lines.append(
                f"| {restart.scenario} | {restart.contender} | {restart.requests} "
                f"| {restart.errors} | {restart.window_requests} "
                f"| {_rate(restart.before.hit_rate)} "
                f"| {hit_cell(restart.after.hit_rate, restart.errors_after)} "
                f"| {' / '.join(map(str, restart.after.per_engine))} | {restart.restart_s:.1f} |"
            )
    if "partial" in header:
        lines += [
            "",
            f"**Partial run**: it stopped at `{header['partial']}`; the runs above are "
            "all it measured.",
        ]
    lines += ["", "Target (kv_aware against ours cache_aware, one process each):", ""]
    lines += verdicts(runs, evicting, roomy)
    several = replica_verdicts(runs, evicting, roomy)
    if several:
        lines += ["", "Targets of several routers, and of kv_aware as an operator starts it:", ""]
        lines += several
    views = [(r.scenario, r.contender, kv_summary(r.router_kv, r.window.hit_tokens)) for r in runs]
    views += [(r.scenario, f"{r.contender}, restarted", kv_summary(r.router_kv)) for r in restarts]
    if any(view for _, _, view in views):
        lines += ["", "The router's own view after each kv_aware run (one process's /metrics):", ""]
        lines += [f"- {scenario}, {name}: {view}" for scenario, name, view in views if view]
    lines += ["", end, ""]
    return "\n".join(lines)

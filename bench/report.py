"""From measurements to the figures the doc shows: per-case rows, ratios, targets, chart.

Each figure is computed over all rounds of a contender and case: requests per CPU-second is
total requests over total CPU (so a long round weighs more than a short one); req/s, p50
and p99 are the medians of the rounds; errors are summed.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.plan import CASES, CONTENDERS, STREAM_EVENTS
from bench.pyspy import Entry
from bench.run import BurstResult, CaseProfile, IdleStreams, Measurement, Session

START = "<!-- bench:results:start -->"
END = "<!-- bench:results:end -->"
RESUME_START = "<!-- bench:resume:start -->"
RESUME_END = "<!-- bench:resume:end -->"
IDLE_RSS_TARGET_MB = 1024
BURST_SLOWDOWN_LIMIT = 1.25
SMG_SHARE_TARGET = 0.85
EVENT_US_TARGET = 25
ADDED_P50_MARGIN_MS = 0.05
P99_SMG_FACTOR = 1.5
C256_SHARE_TARGET = 0.9


@dataclass(frozen=True, slots=True)
class Row:
    contender: str
    case: str
    rounds: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float
    cpu_cores: float
    req_per_cpu: float | None
    req_per_cpu_low: float | None
    req_per_cpu_high: float | None
    peak_rss_mb: float
    wrk_cores: float


def aggregate(measurements: Sequence[Measurement]) -> dict[tuple[str, str], Row]:
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.contender, m.case), []).append(m)
    rows = {}
    for key, runs in groups.items():
        requests = sum(m.requests for m in runs)
        cpu = sum(m.cpu_s for m in runs)
        duration = sum(m.duration_s for m in runs)
        per_round = [m.requests / m.cpu_s for m in runs if m.cpu_s > 0]
        rows[key] = Row(
            contender=key[0],
            case=key[1],
            rounds=len(runs),
            requests=requests,
            rps=statistics.median(m.requests / m.duration_s for m in runs),
            p50_ms=statistics.median(m.p50_ms for m in runs),
            p99_ms=statistics.median(m.p99_ms for m in runs),
            errors=sum(m.errors for m in runs),
            cpu_s=cpu,
            cpu_cores=cpu / duration if duration else 0.0,
            req_per_cpu=requests / cpu if cpu > 0 else None,
            req_per_cpu_low=min(per_round) if per_round else None,
            req_per_cpu_high=max(per_round) if per_round else None,
            peak_rss_mb=max(m.peak_rss_kb for m in runs) / 1024,
            wrk_cores=sum(m.wrk_cpu_s for m in runs) / duration if duration else 0.0,
        )
    return rows


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def cpu_us_per_event(row: Row | None) -> float | None:
    if row is None or row.requests == 0:
        return None
    return row.cpu_s / (row.requests * STREAM_EVENTS) * 1e6


@dataclass(frozen=True, slots=True)
class Verdict:
    target: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def word(self) -> str:
        return {True: "met", False: "**missed**", None: "not measured"}[self.met]


def targets(
    rows: dict[tuple[str, str], Row], bursts: Sequence[BurstResult], idle: Sequence[IdleStreams]
) -> list[Verdict]:
    """The performance targets for `ours`, each with its figure from this run: against smg
    in the same run where a target is set against it, else absolute."""
    ours = {case: row for (contender, case), row in rows.items() if contender == "ours"}
    smg = {case: row for (contender, case), row in rows.items() if contender == "smg"}
    verdicts = []
    for case in ("unary-c32", "stream-c32"):
        share = _ratio(_cpu(ours.get(case)), _cpu(smg.get(case)))
        verdicts.append(
            Verdict(
                f"ours / smg req per CPU-s >= {SMG_SHARE_TARGET}, {case}",
                _num(share, 2),
                None if share is None else share >= SMG_SHARE_TARGET,
            )
        )
    per_event = cpu_us_per_event(ours.get("paced-c64"))
    verdicts.append(
        Verdict(
            f"<= {EVENT_US_TARGET} us router CPU per relayed SSE event (paced)",
            f"{per_event:.1f} us (smg {_num(cpu_us_per_event(smg.get('paced-c64')), 1)})"
            if per_event is not None
            else "n/a",
            None if per_event is None else per_event <= EVENT_US_TARGET,
        )
    )
    direct, mine, theirs = (
        rows.get(("direct", "unary-c1")),
        ours.get("unary-c1"),
        smg.get("unary-c1"),
    )
    if direct and mine and theirs:
        added, smg_added = mine.p50_ms - direct.p50_ms, theirs.p50_ms - direct.p50_ms
        verdicts.append(
            Verdict(
                f"added p50 at c=1 <= smg's + {ADDED_P50_MARGIN_MS} ms",
                f"+{added:.3f} ms (smg +{smg_added:.3f} ms)",
                added <= smg_added + ADDED_P50_MARGIN_MS,
            )
        )
    else:
        verdicts.append(
            Verdict(f"added p50 at c=1 <= smg's + {ADDED_P50_MARGIN_MS} ms", "n/a", None)
        )
    c32, c256, smg256 = ours.get("unary-c32"), ours.get("unary-c256"), smg.get("unary-c256")
    if c256 and smg256:
        verdicts.append(
            Verdict(
                f"unary c=256 p99 <= {P99_SMG_FACTOR}x smg's",
                f"{c256.p99_ms:.1f} ms (smg {smg256.p99_ms:.1f} ms)",
                c256.p99_ms <= P99_SMG_FACTOR * smg256.p99_ms,
            )
        )
    else:
        verdicts.append(Verdict(f"unary c=256 p99 <= {P99_SMG_FACTOR}x smg's", "n/a", None))
    share_256 = _ratio(_cpu(c256), _cpu(c32))
    verdicts.append(
        Verdict(
            f"unary c=256 req per CPU-s >= {C256_SHARE_TARGET:.0%} of c=32",
            "n/a" if share_256 is None else f"{share_256:.0%}",
            None if share_256 is None else share_256 >= C256_SHARE_TARGET,
        )
    )
    verdicts.append(_idle_verdict(idle))
    burst = next((b for b in bursts if b.contender == "ours"), None)
    if burst is not None:
        slowdown = burst.after.p50_ms / burst.before.p50_ms if burst.before.p50_ms else None
        verdicts.append(
            Verdict(
                f"no slow-down after a c=256 burst (c=1 p50 after <= {BURST_SLOWDOWN_LIMIT}x before)",
                f"{burst.before.p50_ms:.3f} -> {burst.after.p50_ms:.3f} ms",
                None if slowdown is None else slowdown <= BURST_SLOWDOWN_LIMIT,
            )
        )
    stretch = _ratio(_cpu(c32), _cpu(smg.get("unary-c32")))
    verdicts.append(
        Verdict(
            "stretch: ours / smg req per CPU-s >= 1 (c=32)",
            _num(stretch, 2),
            None if stretch is None else stretch >= 1,
        )
    )
    return verdicts


def _cpu(row: Row | None) -> float | None:
    return None if row is None else row.req_per_cpu


def _idle_verdict(idle: Sequence[IdleStreams]) -> Verdict:
    """Measured at 10,000 when a run held that many; else projected from the largest run
    that was measured (a run whose streams did not all open in time measured nothing)."""
    target = "10,000 idle streams in < 1 GiB RSS"
    measured = [i for i in idle if i.rss_held_kb is not None]
    full = next((i for i in measured if i.opened >= 10_000), None)
    if full is not None and full.rss_held_kb is not None:
        mb = full.rss_held_kb / 1024
        return Verdict(target, f"{mb:,.0f} MB through {full.contender}", mb < IDLE_RSS_TARGET_MB)
    largest = max(measured, key=lambda i: i.opened, default=None)
    if largest is None or largest.opened == 0 or largest.rss_held_kb is None:
        return Verdict(target, "n/a (not measured)", None)
    per_stream = (largest.rss_held_kb - largest.rss_before_kb) / largest.opened
    projected = (largest.rss_before_kb + per_stream * 10_000) / 1024
    return Verdict(
        target,
        f"~{projected:,.0f} MB projected from {largest.opened:,} streams",
        projected < IDLE_RSS_TARGET_MB,
    )


def results_markdown(
    session: Session, header: dict[str, str], png_name: str | None, *, resume: bool = False
) -> str:
    """The results block; `resume`: the block of a run on the vLLM fleet (resume capture
    on against off), without the targets, which belong to the default fleet's run."""
    rows = aggregate(session.measurements)
    contenders = [c for c in CONTENDERS if any(k[0] == c for k in rows)]
    cases = [c for c in CASES if any(k[1] == c for k in rows)]
    start, end = (RESUME_START, RESUME_END) if resume else (START, END)
    out = [start, "## Resume capture: the relay's cost" if resume else "## Results", ""]
    out.append(
        f"Generated by `{header['command']}` on {header['date']}. Machine: {header['cpus']} CPUs "
        f"({header['cpu_model']}), Linux {header['kernel']}, load average at start {header['load_at_start']}."
    )
    out.append(
        f"Versions: Python {header['python']}, trio {header['trio']}, httptools {header.get('httptools', 'n/a')}, h11 {header['h11']}, "
        f"hypercorn {header['hypercorn']}, smg {header['smg']}, "
        f"litellm {header.get('litellm', 'n/a')}, {header['wrk']}."
    )
    out.append(
        f"Each figure: {header['rounds']} interleaved rounds of {header['duration']} s per contender "
        f"and case (wrk, 1 thread, keep-alive); fleet: {header['fleet']} fake workers, zero "
        "token latency except where paced."
    )
    if "baseline" in header:
        out.append(
            f"`ours-base`: the router as of `{header['baseline']}`, the same flags as `ours`."
        )
    if "build" in header:
        out.append(f"`ours`: {header['build']}.")
    out.append("")
    if png_name:
        out += [f"![requests per router CPU-second and p99 latency per case]({png_name})", ""]
    if not resume:
        out += ["### Targets (ours)", "", "| target | this run | verdict |", "|---|---|---|"]
        for verdict in targets(rows, session.bursts, session.idle):
            out.append(f"| {verdict.target} | {verdict.measured} | {verdict.word} |")
        out.append("")
    out += [
        "### Per contender and case",
        "",
        "CPU is the contender's own (every process of it; for `direct`, the fake worker's). "
        "Peak RSS is the process tree's high-water mark since start.",
        "",
        "| case | contender | req/s | p50 ms | p99 ms | errors | CPU (cores) "
        "| **req per CPU-s** (round min-max) | peak RSS MB | wrk CPU (cores) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for case in cases:
        for contender in contenders:
            row = rows.get((contender, case))
            if row is None:
                continue
            spread = (
                f" ({_num(row.req_per_cpu_low)}-{_num(row.req_per_cpu_high)})"
                if row.rounds > 1
                else ""
            )
            out.append(
                f"| {case} | {contender} | {_num(row.rps)} | {row.p50_ms:.2f} | {row.p99_ms:.2f} "
                f"| {row.errors} | {row.cpu_cores:.2f} | **{_num(row.req_per_cpu)}**{spread} "
                f"| {row.peak_rss_mb:.0f} | {row.wrk_cores:.2f} |"
            )
    out += ["", "### Ratios (requests per CPU-second unless stated)", ""]
    out += _ratios(rows, contenders, cases)
    if session.bursts:
        out += [
            "",
            "### Burst at c=256, then c=1",
            "",
            "| contender | c=1 before: req/s, p50, p99 | burst: req/s, p99, errors | c=1 after: req/s, p50, p99 |",
            "|---|---|---|---|",
        ]
        for b in session.bursts:
            out.append(
                f"| {b.contender} | {_num(b.before.rps)}, {b.before.p50_ms:.3f} ms, {b.before.p99_ms:.2f} ms "
                f"| {_num(b.burst.rps)}, {b.burst.p99_ms:.1f} ms, {b.burst.errors} "
                f"| {_num(b.after.rps)}, {b.after.p50_ms:.3f} ms, {b.after.p99_ms:.2f} ms |"
            )
    if session.idle:
        out += ["", "### Idle streams", ""]
        for i in session.idle:
            if i.rss_held_kb is None:
                out.append(
                    f"- {i.opened:,} of {i.wanted:,} SSE streams through `{i.contender}` opened before the "
                    f"time limit ({i.failed} failed to open): RSS with them open not measured."
                )
                continue
            per_stream = (i.rss_held_kb - i.rss_before_kb) / i.opened if i.opened else 0.0
            out.append(
                f"- {i.opened:,} of {i.wanted:,} SSE streams held open through `{i.contender}` "
                f"({i.failed} failed to open; all open after {i.open_s:.1f} s): RSS "
                f"{i.rss_before_kb / 1024:,.0f} MB before, {i.rss_held_kb / 1024:,.0f} MB with them open "
                f"({per_stream:.1f} kB per stream), peak {i.peak_rss_kb / 1024:,.0f} MB."
            )
    for profiled in session.profiles:
        out += _profile(profiled)
    if session.notes:
        out += ["", "Notes: " + " ".join(session.notes)]
    out += ["", end]
    return "\n".join(out) + "\n"


MODULES_SHOWN = 15
"""Our modules listed per profile, the most self time first."""


def _entries(entries: Sequence[Entry], function: bool = True) -> list[str]:
    if function:
        head = ["| self % | total % | function | where |", "|--:|--:|---|---|"]
        return head + [
            f"| {e.self_pct:.1f} | {e.total_pct:.1f} | `{e.function}` | {e.where} |"
            for e in entries
        ]
    head = ["| self % | total % | module |", "|--:|--:|---|"]
    return head + [f"| {e.self_pct:.1f} | {e.total_pct:.1f} | {e.where} |" for e in entries]


def _profile(profiled: CaseProfile) -> list[str]:
    profile = profiled.profile
    packages = ", ".join(
        f"{name} {pct:.0f}%" for name, pct in profile.by_package.items() if pct >= 0.5
    )
    out = [
        "",
        f"### Profile: `ours`, {profiled.case} (py-spy, {profile.samples:,} samples)",
        "",
        f"Self time by package: {packages}.",
        "",
        *_entries(profile.top_self),
        "",
        "Our own modules, by self time (total: anywhere on the stack):",
        "",
        *_entries(profile.by_module[:MODULES_SHOWN], function=False),
        "",
        "Our own functions by self time:",
        "",
        *_entries(profile.top_router),
        "",
    ]
    if profiled.syscalls is None:
        return [*out, "System calls: not counted (strace is not installed)."]
    calls = ", ".join(
        f"{c.name} {c.per_request:.2f}"
        + (f" ({c.errors / c.calls:.0%} failed)" if c.errors else "")
        for c in profiled.syscalls
        if c.per_request >= 0.01
    )
    return [
        *out,
        f"System calls per request (strace -c -f over {profiled.traced_requests:,} requests, "
        f"a window of its own): {calls}.",
    ]


def _ratios(rows: dict[tuple[str, str], Row], contenders: list[str], cases: list[str]) -> list[str]:
    pairs = [
        ("ours / smg", "ours", "smg"),
        ("ours / ours-base", "ours", "ours-base"),
        ("ours / ours-pure", "ours", "ours-pure"),
        ("ours-pure / smg", "ours-pure", "smg"),
        ("ours-resume / ours-noresume", "ours-resume", "ours-noresume"),
        ("ours-resume / smg", "ours-resume", "smg"),
        ("ours-noresume / smg", "ours-noresume", "smg"),
        ("ours / direct", "ours", "direct"),
        ("ours-hypercorn / ours", "ours-hypercorn", "ours"),
        ("ours-2proc / ours", "ours-2proc", "ours"),
        ("smg / direct", "smg", "direct"),
        ("ours / litellm", "ours", "litellm"),
        ("litellm / direct", "litellm", "direct"),
        ("ours / trio-floor", "ours", "trio-floor"),
        ("smg / trio-floor", "smg", "trio-floor"),
    ]
    pairs = [p for p in pairs if p[1] in contenders and p[2] in contenders]
    lines = ["| ratio | " + " | ".join(cases) + " |", "|---|" + "--:|" * len(cases)]
    for label, a, b in pairs:
        cells = []
        for case in cases:
            ra, rb = rows.get((a, case)), rows.get((b, case))
            cells.append(
                _num(_ratio(ra.req_per_cpu if ra else None, rb.req_per_cpu if rb else None), 2)
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    direct = rows.get(("direct", "unary-c1"))
    if direct:
        added = [
            f"{c} {rows[(c, 'unary-c1')].p50_ms - direct.p50_ms:+.3f} ms"
            for c in contenders
            if c != "direct" and (c, "unary-c1") in rows
        ]
        lines += [
            "",
            f"Added p50 over direct at c=1 (direct {direct.p50_ms:.3f} ms): "
            + ", ".join(added)
            + ".",
        ]
    for case in ("paced-c64", "stream-c32"):
        per_event = [
            f"{c} {value:.1f} us"
            for c in contenders
            if c != "direct" and (value := cpu_us_per_event(rows.get((c, case)))) is not None
        ]
        if per_event:
            lines += ["", f"CPU per relayed SSE event, {case}: " + ", ".join(per_event) + "."]
    return lines


def write_doc(path: Path, block: str, *, start: str = START, end: str = END) -> None:
    """Replace the block of `path` between `start` and `end` (the results block unless
    told), keeping the text around it; a file without it gets the block at its end, and a
    new file a title too.
    """
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + block.rstrip("\n") + tail
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "# Performance\n\n") + block
    path.write_text(text)


def write_chart(path: Path, measurements: Sequence[Measurement]) -> None:
    """Two panels per case, one bar per contender: requests per CPU-second, and p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = aggregate(measurements)
    contenders = [c for c in CONTENDERS if any(k[0] == c for k in rows)]
    cases = [c for c in CASES if any(k[1] == c for k in rows)]
    width = 0.8 / max(1, len(contenders))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for index, contender in enumerate(contenders):
        xs = [i + index * width for i in range(len(cases))]
        efficiency = [
            (rows[(contender, c)].req_per_cpu or 0) if (contender, c) in rows else 0 for c in cases
        ]
        p99 = [rows[(contender, c)].p99_ms if (contender, c) in rows else 0 for c in cases]
        left.bar(xs, efficiency, width, label=contender)
        right.bar(xs, p99, width, label=contender)
    for axis, title in (
        (left, "requests per CPU-second (higher is better)"),
        (right, "p99 latency, ms (log; lower is better)"),
    ):
        axis.set_xticks([i + width * (len(contenders) - 1) / 2 for i in range(len(cases))])
        axis.set_xticklabels(cases, rotation=20)
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The traffic benchmark's figures and its results block (pure: no process, no clock).

`python -m bench --traffic` (bench/traffic.py) measures; this module judges each figure
against the target the issue set and writes the Markdown block, between its own markers,
into docs/performance.md, keeping every other line of the page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

START = "<!-- bench:traffic:start -->"
END = "<!-- bench:traffic:end -->"
# Quantile of the standard normal distribution leaving 0.05% in each tail: a bound that a
# fair split crosses once in two thousand runs.
Z_999 = 3.29


def percentile(values: Sequence[float], share: float) -> float:
    """Nearest-rank percentile; NaN for no values (unknown is not zero)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


def binomial_bounds(trials: int, share: float, z: float = Z_999) -> tuple[int, int]:
    """The counts a fair draw of `share` over `trials` stays within, at `z` deviations."""
    mean = trials * share
    spread = z * math.sqrt(trials * share * (1 - share))
    return math.floor(mean - spread), math.ceil(mean + spread)


@dataclass(frozen=True, slots=True)
class Flood:
    """What wrk's flood got in one run."""

    answers: int
    errors: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class Latencies:
    """One measured client's answers in one run: latencies of the 200s, the rest, and the
    flood beside it (None: alone)."""

    label: str
    ok_ms: tuple[float, ...]
    failed: int
    flood: Flood | None = None

    @property
    def p50(self) -> float:
        return percentile(self.ok_ms, 0.50)

    @property
    def p99(self) -> float:
        return percentile(self.ok_ms, 0.99)


@dataclass(frozen=True, slots=True)
class Disconnects:
    clients: int
    queued: int
    """The queue depth the router reported with every one of them waiting."""
    left_counted: int
    dispatched: int
    """Requests the workers received from the clients that left."""
    active_after: int
    """Admission slots held once they left, beside the holders' own."""
    holders: int
    seconds_to_empty: float


@dataclass(frozen=True, slots=True)
class Canary:
    requests: int
    share: float
    canary: int
    stable: int
    failed: int
    rewrites_counted: int

    @property
    def bounds(self) -> tuple[int, int]:
        return binomial_bounds(self.requests, self.share)


@dataclass(frozen=True, slots=True)
class Fallback:
    requests: int
    failed: int
    marked: int
    counted: int
    """`router_model_fallbacks_total` after the run."""
    fallback_dispatches: int
    killed_at_s: float
    seconds: float


@dataclass(frozen=True, slots=True)
class TrafficResults:
    quick: bool
    date: str
    command: str
    seconds_per_run: float
    load: tuple[float, float]
    """The machine's one-minute load average before and after the runs."""
    slots: int
    service_ms: float
    flood_clients: int
    idle: Latencies
    fair: Latencies
    fifo: Latencies
    high: Latencies
    high_fifo: Latencies
    disconnects: Disconnects
    canary: Canary
    fallback: Fallback


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.1f}"


def markdown(r: TrafficResults) -> str:
    """The results block: what was run, one table of targets, one of latencies."""
    ratio = r.fair.p99 / r.idle.p99 if r.idle.p99 else math.nan
    low, high = r.canary.bounds
    d = r.disconnects
    f = r.fallback
    targets = [
        (
            "light tenant p99 under the flood, fair shares, within 2x of idle",
            f"{_ms(r.fair.p99)} ms vs {_ms(r.idle.p99)} ms idle ({ratio:.2f}x)",
            ratio <= 2.0,
        ),
        (
            "high-priority p99 under the flood, classes, below the same traffic's FIFO p99",
            f"{_ms(r.high.p99)} ms vs {_ms(r.high_fifo.p99)} ms FIFO",
            r.high.p99 < r.high_fifo.p99,
        ),
        (
            f"{d.clients:,} queued clients that disconnect: 0 dispatched, 0 slots held",
            f"queue at {d.queued:,}; then {d.dispatched} dispatched, {d.active_after} slots "
            f"held beside the {d.holders} holders, {d.left_counted:,} counted as client_left; "
            f"queue empty {d.seconds_to_empty:.2f} s after they closed",
            d.dispatched == 0 and d.active_after == 0 and d.left_counted == d.clients,
        ),
        (
            f"canary at {r.canary.share:.0%} over {r.canary.requests:,} requests within "
            f"binomial bounds ({low}..{high})",
            f"{r.canary.canary:,} to the canary, {r.canary.stable:,} to the stable model, "
            f"{r.canary.failed} failed, {r.canary.rewrites_counted:,} rewrites counted",
            low <= r.canary.canary <= high and r.canary.failed == 0,
        ),
        (
            "fallback under a down fleet: 0 failures, every fallback counted and marked",
            f"{f.requests:,} requests, {f.failed} failed, {f.marked:,} marked, "
            f"{f.counted:,} counted, {f.fallback_dispatches:,} served by the fallback",
            f.failed == 0 and f.marked == f.counted == f.fallback_dispatches and f.marked > 0,
        ),
    ]
    lines = [
        START,
        "## Traffic policy at overload",
        "",
        f"Generated on {r.date}{' (--quick)' if r.quick else ''}; `{r.command}`; the 2-core "
        f"machine's load average {r.load[0]:.1f} before, {r.load[1]:.1f} after (it is shared). "
        "Fake workers "
        f"answer in {r.service_ms:g} ms; the router serves {r.slots} requests at once "
        f"(`--max-concurrent-requests {r.slots}`), so the fleet's capacity is "
        f"{r.slots * 1000 / r.service_ms:,.0f} requests/s. The flood is wrk with "
        f"{r.flood_clients} connections in a closed loop ({r.flood_clients // r.slots}x the "
        f"slots: {r.flood_clients - r.slots} of its requests wait at every moment), started a "
        "second before the measured client; the light tenant and the high-priority client "
        "are one Python client each that waits 20 ms between requests, measured for "
        f"{r.seconds_per_run:g} s. Latency is that client's, from request to the end of the "
        "answer: on an idle router its queue wait is zero and its latency the fleet's time "
        "plus the router's, so the target is read on latency.",
        "",
        "| Target | Measured | Verdict |",
        "|---|---|---|",
        *(f"| {name} | {value} | {_verdict(met)} |" for name, value, met in targets),
        "",
        "| Run | Client | Answers | Failed | p50 ms | p99 ms | Flood answers | Flood errors | Flood p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, group in (
        ("idle router", r.idle),
        ("flood, fair shares (tenant header)", r.fair),
        ("flood, one FIFO line", r.fifo),
        ("flood of class low, classes", r.high),
        ("same traffic, one FIFO line", r.high_fifo),
    ):
        flood = group.flood
        beside = (
            f"{flood.answers:,} | {flood.errors} | {_ms(flood.p99_ms)}"
            if flood is not None
            else "- | - | -"
        )
        lines.append(
            f"| {run} | {group.label} | {len(group.ok_ms):,} | {group.failed} | "
            f"{_ms(group.p50)} | {_ms(group.p99)} | {beside} |"
        )
    lines += [
        "",
        f"The down fleet: two workers of the model are killed (SIGKILL) {f.killed_at_s:.1f} s "
        f"into a {f.seconds:g} s run of 16 clients; its fallback is one worker of another "
        "model. The canary: an alias of two models, 95 and 5, over HTTP at 32 clients, "
        "counted by the workers themselves.",
        END,
        "",
    ]
    return "\n".join(lines)


def write_block(path: Path, block: str) -> None:
    """Replace the traffic block of `path` (appended when it has none), keeping the rest."""
    text = path.read_text() if path.exists() else ""
    if START in text and END in text:
        head, _, rest = text.partition(START)
        _, _, tail = rest.partition(END)
        text = head + block.rstrip("\n") + tail
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    path.write_text(text)

"""What an engine's Prometheus `/metrics` says about the work it holds.

One mapping names every engine gauge the drain, the fake worker and any load reader use,
so a renamed metric is fixed in one place. A name that is wrong reads as a missing metric,
and a missing work gauge reads as unknown, never as idle: an idle reading is what lets a
drain cut live requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    """The gauges one engine exports, split by whether a work reading needs them.

    `running` and `queued` are required: without either, the engine's load is unknown.
    `handoff` gauges are optional: the engine exports them only in PD mode, and an absent
    one holds no work. `kv_usage` lists spellings of one gauge, newest first; the first
    present is read.
    """

    running: str
    queued: str
    handoff: tuple[str, ...]
    kv_usage: tuple[str, ...]

    @property
    def required(self) -> tuple[str, str]:
        return (self.running, self.queued)

    @property
    def optional(self) -> tuple[str, ...]:
        return self.handoff


ENGINE_METRICS: Mapping[str, EngineMetricNames] = MappingProxyType(
    {
        "sglang": EngineMetricNames(
            running="sglang:num_running_reqs",
            queued="sglang:num_queue_reqs",
            # A prefill worker can show no running and no queued requests while KV
            # transfers are outstanding; stopping it then strands the decode side.
            handoff=(
                "sglang:num_prefill_bootstrap_queue_reqs",
                "sglang:num_prefill_inflight_queue_reqs",
                "sglang:num_decode_prealloc_queue_reqs",
                "sglang:num_decode_transfer_queue_reqs",
            ),
            kv_usage=("sglang:token_usage",),
        ),
        "vllm": EngineMetricNames(
            running="vllm:num_requests_running",
            queued="vllm:num_requests_waiting",
            handoff=(),
            # Older releases spell it gpu_cache_usage_perc; reading only one spelling
            # reports "no KV in use" on the other, silently.
            kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ),
    }
)

ENGINES: frozenset[str] = frozenset(ENGINE_METRICS)


def metric_names(engine: str) -> EngineMetricNames:
    """The gauges of `engine`; a ValueError names the known engines for any other."""
    try:
        return ENGINE_METRICS[engine]
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise ValueError(
            f"unknown engine {engine!r}: its metric names are not known (known engines: {known})"
        ) from None


@dataclass(frozen=True)
class EngineLoad:
    """One reading of an engine's gauges, each summed over every rank; None is unknown.

    `handoff` is 0 when the engine exports no handoff gauge, and None only when one it
    exports cannot be read. `kv_usage` is the fullest rank's fraction of KV cache in use.
    """

    running: float | None
    queued: float | None
    handoff: float | None
    kv_usage: float | None

    @property
    def total(self) -> float | None:
        """Requests the engine holds, or None when any part is unknown (never idle)."""
        if self.running is None or self.queued is None or self.handoff is None:
            return None
        return self.running + self.queued + self.handoff


UNREADABLE = EngineLoad(running=None, queued=None, handoff=None, kv_usage=None)


def parse_engine_load(text: str, engine: str) -> EngineLoad:
    """Read `engine`'s load from a Prometheus text exposition.

    Work gauges are summed over every label set, since each TP/DP rank exports its own
    series and a busy rank must never be hidden by an idle one. A missing required gauge,
    or a NaN or infinite value in any series of a gauge, makes that gauge None. Text that
    does not parse makes every field None. An unknown `engine` raises ValueError.
    """
    names = metric_names(engine)
    try:
        series = _collect_series(text)
    except ValueError:
        return UNREADABLE
    handoff: float | None = 0.0
    for name in names.handoff:
        if name in series:
            value = _sum(series[name])
            handoff = None if value is None or handoff is None else handoff + value
    kv_usage = next(
        (_max(series[name]) for name in names.kv_usage if name in series),
        None,
    )
    return EngineLoad(
        running=_sum(series.get(names.running)),
        queued=_sum(series.get(names.queued)),
        handoff=handoff,
        kv_usage=kv_usage,
    )


def _collect_series(text: str) -> dict[str, list[float]]:
    """Every sample value by exact sample name.

    Matching the sample name, not the family name, leaves out `_created`, `_total`,
    `_bucket` and the like. The parser is lazy, so a ValueError can surface mid-way; the
    caller then discards everything read so far.
    """
    series: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(float(sample.value))
    return series


def _sum(values: list[float] | None) -> float | None:
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return math.fsum(values)


def _max(values: list[float]) -> float | None:
    # A fraction per rank: a sum would exceed 1, a mean would hide a full rank.
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return max(values)

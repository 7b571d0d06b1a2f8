"""An engine's own load, per DP rank, from each of the three ways engines tell it.

- vLLM (and SGLang) `/metrics`: the running and waiting gauges of the one mapping of
  engine metric names (`router.engines.metrics`), one series per rank (vLLM labels its
  engine cores `engine`, SGLang its ranks `dp_rank`), and the KV-cache usage gauge. The
  page is large (vLLM's ~50 kB, mostly histograms); only the lines of the families read
  are handed to the Prometheus parser, which is what keeps a reading under a
  millisecond of the router's time (docs/performance.md, "Engine load").
- SGLang's `/v1/loads`: a JSON snapshot per rank (`num_running_reqs`,
  `num_waiting_reqs`, `token_usage`).
- vLLM's `/load` (with `--enable-server-load-tracking`): `{"server_load": N}`, the
  requests its API server holds, counted from the moment its handler takes one (before
  tokenizing) to the end of the answer; one count for the whole engine, every rank.
- SGLang's pushed load stream (`--load-publish-endpoint`): ZMQ messages framed like the KV
  events, `[topic, 8-byte big-endian sequence, msgpack LoadStat]`, a `LoadStat` being the
  tagged array `["LoadStat", running, waiting, kv_tokens, kv_capacity, rank]`; one
  publisher per rank, each message on change and at least every second.

Whatever the source, a rank whose running or waiting count is missing, negative, not a
finite number or not a number at all is left out of the answer, so its load is unknown;
an answer that cannot be read at all is a `BadReading`. Nothing here is ever read as
zero for want of a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from router.engines.metrics import ENGINE_METRICS, EngineMetricNames

RANK_LABELS = ("engine", "dp_rank")
"""The label naming a series' DP rank: vLLM's engine-core index, SGLang's rank."""


class BadReading(Exception):
    """An answer that cannot be read as load at all; the message says what was wrong."""


@dataclass(frozen=True, slots=True)
class RankReading:
    """One DP rank's requests as its engine counts them."""

    running: float
    waiting: float
    kv_usage: float | None = None
    """The fraction of the KV cache in use, when the engine says."""

    @property
    def total(self) -> float:
        return self.running + self.waiting


def whole_engine(readings: dict[int, RankReading], dp_size: int) -> RankReading | None:
    """The sum over every rank, for a worker that is the whole engine; None unless all
    `dp_size` ranks were read (a busy rank must never hide behind an unread one)."""
    if len(readings) < dp_size or not readings:
        return None
    usages = [r.kv_usage for r in readings.values() if r.kv_usage is not None]
    return RankReading(
        running=math.fsum(r.running for r in readings.values()),
        waiting=math.fsum(r.waiting for r in readings.values()),
        kv_usage=max(usages) if usages else None,
    )


def _count(value: Any) -> float | None:
    """A request count as an engine states it: a finite number, not below zero."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def _fraction(value: Any) -> float | None:
    number = _count(value)
    return number if number is not None and number <= 1.0 else None


# -- /metrics ----------------------------------------------------------------------------


def _wanted_names(engine: str | None) -> list[EngineMetricNames]:
    if engine is not None and engine in ENGINE_METRICS:
        return [ENGINE_METRICS[engine]]
    return list(ENGINE_METRICS.values())  # an engine of unknown kind: whichever it has


def metrics_readings(text: str, engine: str | None) -> dict[int, RankReading]:
    """Per rank, the running and waiting gauges (and KV usage) in a Prometheus exposition
    of `engine` (None: an engine of unknown kind; the first mapping whose gauges appear).

    A rank with either count missing or unusable is left out. Raises BadReading when the
    text does not parse, or holds neither gauge of any mapping.
    """
    for names in _wanted_names(engine):
        wanted = (names.running, names.queued, *names.kv_usage)
        lines = [line for line in text.splitlines() if line.startswith(wanted)]
        if not lines:
            continue
        try:
            families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
        except ValueError as exc:
            raise BadReading(f"the metrics page does not parse: {exc}") from None
        running: dict[int, float | None] = {}
        waiting: dict[int, float | None] = {}
        usage: dict[int, float | None] = {}
        for family in families:
            for sample in family.samples:
                rank = _rank_of(sample.labels)
                if rank is None:
                    continue
                if sample.name == names.running:
                    _add(running, rank, _count(sample.value))
                elif sample.name == names.queued:
                    _add(waiting, rank, _count(sample.value))
                elif sample.name in names.kv_usage and rank not in usage:
                    usage[rank] = _fraction(sample.value)
        readings = {}
        for rank in running.keys() & waiting.keys():
            run, wait = running[rank], waiting[rank]
            if run is not None and wait is not None:
                readings[rank] = RankReading(run, wait, usage.get(rank))
        if not running and not waiting:
            continue
        return readings
    raise BadReading("the metrics page has no running or waiting gauge of a known engine")


def _rank_of(labels: dict[str, str]) -> int | None:
    """The series' DP rank (0 when unlabelled); None for a label that is not a rank."""
    for label in RANK_LABELS:
        if label in labels:
            try:
                rank = int(labels[label])
            except ValueError:
                return None
            return rank if rank >= 0 else None
    return 0


def _add(counts: dict[int, float | None], rank: int, value: float | None) -> None:
    """Sum series of one rank (one per served model name); an unusable one spoils it."""
    before = counts.get(rank, 0.0)
    counts[rank] = None if before is None or value is None else before + value


# -- SGLang's /v1/loads ------------------------------------------------------------------


def loads_readings(body: Any) -> dict[int, RankReading]:
    """Per rank, an SGLang `/v1/loads` answer (`{"loads": [{"dp_rank", "num_running_reqs",
    "num_waiting_reqs", "token_usage", ...}, ...]}`). Raises BadReading when it is not
    that shape at all; a rank entry with an unusable count is left out."""
    entries = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        raise BadReading("the /v1/loads answer has no 'loads' list")
    readings: dict[int, RankReading] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        rank = entry.get("dp_rank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            continue
        running = _count(entry.get("num_running_reqs"))
        waiting = _count(entry.get("num_waiting_reqs"))
        if running is None or waiting is None:
            continue
        readings[rank] = RankReading(running, waiting, _fraction(entry.get("token_usage")))
    return readings


# -- vLLM's /load ------------------------------------------------------------------------


def server_load_count(body: Any) -> float:
    """The count of a vLLM `/load` answer (`{"server_load": N}`). Raises BadReading for any
    other shape, or a count that is not a finite number at or above zero (vLLM's counter
    is a plain integer its handlers move; a negative one has lost track)."""
    value = body.get("server_load") if isinstance(body, dict) else None
    count = _count(value)
    if count is None:
        raise BadReading(f"the /load answer has no usable server_load: {body!r:.80}")
    return count


# -- SGLang's pushed load stream ----------------------------------------------------------

LOAD_TOPIC = b"load"
_decoder = msgspec.msgpack.Decoder()


def load_message(frames: list[bytes]) -> tuple[int, RankReading]:
    """The sequence number and reading of one pushed load message. Raises BadReading for
    anything but `[topic, 8-byte sequence, LoadStat]` with usable counts."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise BadReading(f"a load message has 3 frames with an 8-byte sequence, not {frames!r:.80}")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        stat = _decoder.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise BadReading(f"a load message is not msgpack: {exc}") from None
    if not isinstance(stat, list) or len(stat) < 5 or stat[0] != "LoadStat":
        raise BadReading(f"a load message is not a LoadStat: {stat!r:.80}")
    running, waiting = _count(stat[1]), _count(stat[2])
    if running is None or waiting is None:
        raise BadReading(f"a LoadStat with unusable counts: {stat!r:.80}")
    used, capacity = _count(stat[3]), _count(stat[4])
    usage = used / capacity if used is not None and capacity else None
    return seq, RankReading(running, waiting, usage if usage is None or usage <= 1 else None)

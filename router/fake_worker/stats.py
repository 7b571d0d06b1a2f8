"""What a fake worker saw: the routing counters behind `/debug/routing` and per-rank load.

The counters answer "what did the router decide" (which paths, which DP rank header, which
PD handoff fields); the per-rank load is what `/metrics` and `/v1/loads` report, so the
gauges show the worker's real running and queued requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

# The SGLang PD handoff fields a router injects into request bodies.
HANDOFF_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank")
HANDOFF_HISTORY = 100
HEADER_HISTORY = 100


@dataclass(slots=True)
class RankLoad:
    """One DP rank's requests now and its token totals since start."""

    running: int = 0
    queued: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0


class RoutingStats:
    """Counters of what reached this worker; `reset()` zeroes everything but live counts.

    `inflight` and the per-rank running/queued gauges describe requests still being served,
    so a reset leaves them alone (zeroing them would make the gauges go negative later).
    """

    def __init__(self, dp_size: int) -> None:
        self.loads = [RankLoad() for _ in range(dp_size)]
        self.inflight = 0
        self.reset()

    def reset(self) -> None:
        self.dispatches = 0
        self.failures = 0
        self.disconnects = 0
        self.paths: dict[str, int] = {}
        self.ranks: dict[str, int] = {}
        self.handoffs: deque[dict[str, Any]] = deque(maxlen=HANDOFF_HISTORY)
        # The headers of the latest generation requests, so a test reads what a worker got.
        self.headers: deque[dict[str, str]] = deque(maxlen=HEADER_HISTORY)
        self.peak_inflight = self.inflight
        for load in self.loads:
            load.prompt_tokens = 0
            load.generation_tokens = 0
            load.cached_tokens = 0

    def count_path(self, path: str) -> None:
        self.paths[path] = self.paths.get(path, 0) + 1

    def begin(self) -> None:
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def end(self) -> None:
        self.inflight -= 1

    def record_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Keep one request's headers (names lower-case; a repeated name's values joined)."""
        seen: dict[str, str] = {}
        for name, value in headers:
            key = name.decode("latin-1")
            text = value.decode("latin-1")
            seen[key] = f"{seen[key]}, {text}" if key in seen else text
        self.headers.append(seen)

    def count_dispatch(self, path: str, rank_header: str | None, body: Any) -> None:
        """Record one generation request: its rank header and any PD handoff fields."""
        self.dispatches += 1
        if rank_header is not None:
            self.ranks[rank_header] = self.ranks.get(rank_header, 0) + 1
        if isinstance(body, dict) and any(name in body for name in HANDOFF_FIELDS):
            handoff = {name: body.get(name) for name in HANDOFF_FIELDS}
            handoff["path"] = path
            handoff["dp_rank_header"] = rank_header
            self.handoffs.append(handoff)

    def to_json(self) -> dict[str, Any]:
        """The `/debug/routing` answer."""
        return {
            "dispatches": self.dispatches,
            "failures": self.failures,
            "disconnects": self.disconnects,
            "inflight": self.inflight,
            "peak_inflight": self.peak_inflight,
            "headers": list(self.headers),
            "paths": dict(self.paths),
            "ranks": dict(self.ranks),
            "handoffs": list(self.handoffs),
            "running": [load.running for load in self.loads],
            "queued": [load.queued for load in self.loads],
            "prompt_tokens": sum(load.prompt_tokens for load in self.loads),
            "cached_tokens": sum(load.cached_tokens for load in self.loads),
        }

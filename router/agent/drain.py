"""Waiting until an engine holds no work, before its worker deregisters.

The router never sees requests that went straight to the engine, so the only source of
truth is the engine's own gauges. They lag: a request accepted just before SIGTERM may not
be counted yet, and a finished one may stay counted for seconds. So one zero reading
proves nothing; zero has to hold for a settle window. A reading that cannot be taken ends
the wait at once, loudly: a silent full-timeout wait looks like a busy engine, and
treating unknown as idle cuts live generations.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import trio

from router.engines.metrics import UNREADABLE, EngineLoad, metric_names, parse_engine_load

logger = logging.getLogger("router.agent.drain")


@dataclass(frozen=True, slots=True)
class DrainSettings:
    """How often to read the engine, how long zero must hold, and when to give up."""

    poll_interval_s: float = 0.5
    settle_s: float = 6.0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        if not self.settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class DrainResult(enum.Enum):
    IDLE = "idle"  # zero held for the settle window
    TIMEOUT = "timeout"  # the drain timeout passed while work remained
    UNKNOWN = "unknown"  # a reading was unknown: stopped waiting, loudly


@dataclass(frozen=True)
class DrainReport:
    result: DrainResult
    waited_s: float
    last_load: float | None
    readings: int


async def wait_engine_idle(
    read_load: Callable[[], Awaitable[EngineLoad]], settings: DrainSettings
) -> DrainReport:
    """Poll `read_load` until zero load has held for `settings.settle_s`.

    Readings come every `poll_interval_s`. The settle window runs from the first zero
    reading of an unbroken run of zeros; any non-zero reading restarts it. IDLE once a zero
    reading arrives `settle_s` or more after its run began; UNKNOWN at the first reading
    whose total is None (with a WARNING); TIMEOUT when `timeout_s` has passed since the
    call, even mid-reading. Logs the outcome in one line.

    Cancellation: the reading in progress is cancelled; nothing is logged or returned.
    """
    started = trio.current_time()
    readings = 0
    last_load: float | None = None
    result = DrainResult.TIMEOUT
    unknown: EngineLoad | None = None
    with trio.move_on_after(settings.timeout_s):
        zero_since: float | None = None
        while True:
            load = await read_load()
            now = trio.current_time()
            readings += 1
            last_load = load.total
            if last_load is None:
                result, unknown = DrainResult.UNKNOWN, load
                break
            if last_load == 0:
                if zero_since is None:
                    zero_since = now
                if now - zero_since >= settings.settle_s:
                    result = DrainResult.IDLE
                    break
            else:
                zero_since = None
            await trio.sleep(settings.poll_interval_s)
    report = DrainReport(
        result=result,
        waited_s=trio.current_time() - started,
        last_load=last_load,
        readings=readings,
    )
    _log_report(report, settings, unknown)
    return report


def _log_report(report: DrainReport, settings: DrainSettings, unknown: EngineLoad | None) -> None:
    if unknown is not None:
        unread = ", ".join(
            field for field in ("running", "queued", "handoff") if getattr(unknown, field) is None
        )
        logger.warning(
            "drain: the engine's load cannot be read (unknown: %s) after %.1fs and %d "
            "reading(s); the drain stops waiting rather than claim the engine is idle",
            unread,
            report.waited_s,
            report.readings,
        )
    elif report.result is DrainResult.IDLE:
        logger.info(
            "drain: engine idle for %.1fs, after %.1fs and %d reading(s)",
            settings.settle_s,
            report.waited_s,
            report.readings,
        )
    else:
        # Work is still held; whatever stops the engine next cuts it.
        logger.warning(
            "drain: timed out after %.1fs and %d reading(s); last reading: %s",
            report.waited_s,
            report.readings,
            "none" if report.last_load is None else f"{report.last_load:g} request(s)",
        )


async def read_engine_load(http: httpx.AsyncClient, metrics_url: str, engine: str) -> EngineLoad:
    """One reading of `engine`'s load from `metrics_url`.

    A connect error, a transport failure or any status but 200 gives a reading of all None,
    logged at WARNING with the reason (SGLang answers 404 unless started with
    `--enable-metrics`). An unknown `engine` raises ValueError before any request.
    Timeouts belong to the caller and to `http`'s own settings.

    Cancellation: the request is abandoned and its connection closed by httpx.
    """
    metric_names(engine)
    try:
        response = await http.get(metrics_url)
    except httpx.HTTPError as exc:
        logger.warning("engine metrics at %s unreadable: %s", metrics_url, _describe(exc))
        return UNREADABLE
    if response.status_code != 200:
        logger.warning(
            "engine metrics at %s unreadable: HTTP %d", metrics_url, response.status_code
        )
        return UNREADABLE
    return parse_engine_load(response.text, engine)


def _describe(exc: httpx.HTTPError) -> str:
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__

"""A case's fleet as real vLLM engines (`conformance run --fleet vllm`, or `--fleet
vllm-grpc` for engines serving their gRPC service).

Engines take a minute or more to start, so a run starts a pool once (`open_engine_pool`,
as many as the largest fleet of the selected cases) and lends it to one case at a time:
the case's workers are the pool's first engines, in fleet order. After the case the pool
is put back as it was (`EnginePool.restore`): a stopped engine resumed, a killed one
started again on its port, so the next case meets healthy engines on the same URLs.

What a fake worker's `/debug/routing` tells, an engine's own access log tells here: every
generation request it answered is a `"POST <route> HTTP/1.1" <status>` line in its output
(uvicorn's access log, on by default in vLLM); over gRPC, every `Generate` call it
received is a `Generate request <id>: input_type=...` line of its servicer (answered or
refused). A killed engine keeps the count it had; a
restarted one adds its new lines to it. Requests a stopped engine holds are counted when
it answers them. There is no scripted behaviour and no handoff record: the schema keeps a
case that asks for either off this fleet.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from conformance.engines import Engine, EngineSettings, open_engines
from conformance.fleet import FleetError, RunningWorker
from conformance.model import DEFAULT_MODEL, Case
from conformance.processes import LineCount

# The generation routes a plane may send on (conformance.model.ROUTES), as uvicorn logs
# an answered request: `"POST /v1/chat/completions HTTP/1.1" 200`.
ACCESS_LINE = re.compile(
    r'"POST (?:/v1/chat/completions|/v1/completions|/v1/responses|/v1/messages'
    r'|/v1/embeddings|/generate)(?:\?\S*)? HTTP/1\.[01]" \d{3}'
)
# What vLLM's gRPC servicer (smg-grpc-servicer 0.14.1) logs for every Generate call.
GENERATE_LINE = re.compile(r"Generate request \S+: input_type=")


def dispatch_line(protocol: str) -> re.Pattern[str]:
    """The output line an engine of `protocol` writes per generation request it received."""
    return GENERATE_LINE if protocol == "grpc" else ACCESS_LINE


@dataclass(slots=True)
class LentEngine:
    """One engine as one case's worker: its access-log count since the case began."""

    engine: Engine
    counted: LineCount
    line: re.Pattern[str] = ACCESS_LINE
    earlier: int = 0  # answered by processes of this engine a fault has since replaced
    killed: bool = False
    stopped: bool = False

    @property
    def dispatches(self) -> int:
        return self.earlier + self.counted.count


@dataclass(slots=True)
class EngineFleet:
    workers: dict[str, RunningWorker]
    lent: dict[str, LentEngine] = field(default_factory=dict)

    def __iter__(self) -> Iterator[RunningWorker]:
        return iter(self.workers.values())

    async def routing(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        return {name: {"dispatches": lent.dispatches} for name, lent in self.lent.items()}

    async def set_behaviour(
        self, client: httpx.AsyncClient, names: Sequence[str], behaviour: Mapping[str, Any]
    ) -> None:
        raise FleetError("a real engine has no scripted behaviour (the schema should say so)")

    async def fault(self, name: str, action: str) -> None:
        lent = self.lent[name]
        engine = lent.engine
        if action == "stop":
            engine.stop()
            lent.stopped = True
        elif action == "resume":
            engine.resume()
            lent.stopped = False
        elif action == "kill":
            engine.kill()
            await engine.wait_exited()
            lent.killed = True
        else:
            lent.earlier = lent.dispatches
            await engine.restart()
            lent.counted = engine.output.count(lent.line)
            lent.killed = lent.stopped = False

    def crashed(self) -> list[str]:
        return [
            f"engine {name} ({lent.engine.name}) exited:\n{lent.engine.output.tail(15)}"
            for name, lent in self.lent.items()
            if lent.engine.exited and not lent.killed
        ]


class EnginePool:
    """Engines started once for a run and lent to its cases one at a time."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list(engines)
        self.restarts = 0
        self._lent: EngineFleet | None = None

    @asynccontextmanager
    async def lend(self, case: Case) -> AsyncIterator[EngineFleet]:
        """The case's fleet on the pool's first engines. The caller restores the pool
        after the case (`restore`): not on the way out, so that cancelling a run never
        waits for an engine to start."""
        if len(case.fleet) > len(self.engines):
            raise FleetError(
                f"{case.id} needs {len(case.fleet)} engines; the pool has {len(self.engines)}"
            )
        if self._lent is not None:
            raise FleetError("the engine pool is lent to one case at a time (--jobs 1)")
        fleet = EngineFleet({})
        for spec, engine in zip(case.fleet, self.engines, strict=False):
            line = dispatch_line(engine.settings.protocol)
            fleet.workers[spec.name] = RunningWorker(spec, engine.url, None)
            fleet.lent[spec.name] = LentEngine(engine, engine.output.count(line), line)
        self._lent = fleet
        try:
            yield fleet
        finally:
            self._lent = None

    async def restore(self) -> None:
        """Every engine running and answering again: resumed, or started anew."""
        for engine in self.engines:
            engine.resume()  # SIGCONT to a group that is not stopped changes nothing
        dead = [engine for engine in self.engines if engine.exited]
        async with trio.open_nursery() as nursery:
            for engine in dead:
                nursery.start_soon(engine.restart)
        self.restarts += len(dead)


@asynccontextmanager
async def open_engine_pool(size: int, protocol: str = "http") -> AsyncIterator[EnginePool]:
    """`size` engines serving DEFAULT_MODEL over `protocol` (`http` or `grpc`), healthy
    before the block runs, all stopped (by their process groups) when it ends, on every
    path."""
    settings = EngineSettings(served_model_name=DEFAULT_MODEL, protocol=protocol)
    async with open_engines([settings] * size, name="engine") as engines:
        yield EnginePool(engines)

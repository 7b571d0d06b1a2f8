"""Run cases against planes: fleet up, plane up, steps driven and checked, all torn down.

Each (case, plane) pair gets its own fleet of fake workers (HTTP ones, or gRPC ones on
`fleet="grpc"`) and its own plane process on ports of their own, so pairs run in
parallel (`jobs` at a time) without colliding. On real engines (`fleet="vllm"`, or
`"vllm-grpc"` for engines serving gRPC) the run starts a pool of engines once and lends
it to one pair at a time, restored between pairs (`conformance.engine_fleet`). On a
fleet of gRPC workers a plane needs a gRPC path (`upstream.grpc`), and its gRPC
divergences are the ones that hold.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import httpx
import trio

from conformance.case_run import CaseError, CaseRun, drive_steps
from conformance.client import open_plane_client
from conformance.divergences import Divergence
from conformance.engine_fleet import EnginePool, open_engine_pool
from conformance.engines import EngineUnavailable
from conformance.fleet import FAKE_WORKER_COMMAND, CaseFleet, FleetError, open_fleet
from conformance.model import ENGINE_FLEETS, GRPC_FLEETS, Case, fleet_capabilities
from conformance.planes.base import Launch, Plane, Unsupported
from conformance.processes import Child, ProcessFailed, free_port, open_process
from conformance.sidecars import open_sidecars

Verdict = Literal["pass", "fail", "divergent", "unsupported", "stale", "error"]
# Verdicts that make the run exit non-zero.
FAILING: frozenset[str] = frozenset({"fail", "stale", "error"})
HOST = "127.0.0.1"
CASE_TIMEOUT_S = 180.0
# On engines a case may restart one (35-170 s on 2 cores, longer under load).
ENGINE_CASE_TIMEOUT_S = 600.0
# Signs that a plane on a runner-picked port lost the race for it to another process.
PORT_TAKEN = re.compile(r"address already in use|os error 98|EADDRINUSE", re.IGNORECASE)


# What a case that could not run ends with, rather than a crash of the whole suite.
KNOWN_PROBLEMS: tuple[type[Exception], ...] = (
    CaseError,
    FleetError,
    EngineUnavailable,
    ProcessFailed,
    Unsupported,
    trio.TooSlowError,
)
# What `run_case` catches: those, alone or in the exception groups of the nurseries of the
# case's processes (`known_problem` unwraps them, and re-raises anything else).
_CAUGHT: tuple[type[BaseException], ...] = (*KNOWN_PROBLEMS, BaseExceptionGroup)


@dataclass(slots=True)
class Outcome:
    case_id: str
    plane: str
    verdict: Verdict
    detail: str = ""
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plane_log: str = ""  # the plane's last output lines, kept when the case failed
    # What the runner did beyond the case's own steps (a request resent, and why).
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RunOptions:
    jobs: int = 4
    # Run cases a plane lacks a capability for anyway, to observe it (still reported
    # unsupported, with what happened in the detail).
    run_unsupported: bool = False
    fake_worker_command: Sequence[str] = FAKE_WORKER_COMMAND
    on_outcome: Callable[[Outcome], None] | None = None
    case_timeout_s: float = CASE_TIMEOUT_S
    fleet: str = "fake"  # a FLEET_KINDS word: what the cases' workers are
    # Set by `run_suite` on an engine fleet: the engines lent to each case in turn.
    engine_pool: EnginePool | None = None


# -- one case on one plane ---------------------------------------------------------------


async def run_case(
    case: Case, plane: Plane, divergences: Mapping[str, Divergence], options: RunOptions
) -> Outcome:
    """Run `case` on `plane` and judge it against the plane's known divergences (those of
    the plane's path the fleet takes)."""
    needed = case.capabilities_needed() | fleet_capabilities(options.fleet)
    missing = sorted(needed - plane.capabilities)
    unsupported = None
    if missing:
        notes = [
            f"{name}: {plane.missing_notes[name]}"
            for name in missing
            if name in plane.missing_notes
        ]
        unsupported = f"needs {', '.join(missing)}" + (f" ({'; '.join(notes)})" if notes else "")
    if unsupported is None:
        try:
            plane.check(case)
        except Unsupported as exc:
            unsupported = str(exc)
    if unsupported is not None and not options.run_unsupported:
        return Outcome(case.id, plane.name, "unsupported", unsupported)
    started = trio.current_time()
    try:
        with trio.fail_after(options.case_timeout_s):
            ran = await execute_case(case, plane, options, observe=unsupported is not None)
    except _CAUGHT as exc:
        problem = known_problem(exc)
        seconds = trio.current_time() - started
        if isinstance(problem, Unsupported):
            return Outcome(case.id, plane.name, "unsupported", str(problem), seconds=seconds)
        if isinstance(problem, trio.TooSlowError):
            return Outcome(
                case.id,
                plane.name,
                "error",
                f"did not finish within {options.case_timeout_s:g}s",
                seconds=seconds,
            )
        verdict: Verdict = "unsupported" if unsupported else "error"
        return Outcome(
            case.id, plane.name, verdict, _join(unsupported, str(problem)), seconds=seconds
        )
    seconds = trio.current_time() - started
    failures = ran.failures
    if unsupported is not None:
        seen = "observed: fails" if failures else "observed: passes"
        if ran.substitutions:
            seen += "; substituted " + "; ".join(ran.substitutions)
        outcome = Outcome(
            case.id, plane.name, "unsupported", f"{unsupported} ({seen})", failures, seconds
        )
    else:
        outcome = judge(case.id, plane.name, failures, divergences.get(case.id), seconds)
    if outcome.verdict != "pass":
        outcome.plane_log = ran.plane_log
    outcome.notes = ran.notes
    return outcome


def known_problem(exc: BaseException) -> Exception:
    """The one problem a failed case reports, out of any exception groups the nurseries
    of its processes wrapped it in; anything else (cancellation included) is re-raised."""
    leaves = list(_leaves(exc))
    for leaf in leaves:
        if not isinstance(leaf, KNOWN_PROBLEMS):
            raise exc
    first = leaves[0]
    assert isinstance(first, Exception)
    return first


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def judge(
    case_id: str, plane: str, failures: list[str], divergence: Divergence | None, seconds: float
) -> Outcome:
    """The verdict of a case that ran: its failure lines against the plane's divergence."""
    if divergence is None:
        return Outcome(case_id, plane, "fail" if failures else "pass", "", failures, seconds)
    if not failures:
        detail = f"listed as a divergence but passes: {divergence.observed}"
        return Outcome(case_id, plane, "stale", detail, failures, seconds)
    if not divergence.explains(failures):
        pattern = divergence.failure_matches.pattern if divergence.failure_matches else ""
        detail = f"fails otherwise than its recorded divergence (failure_matches {pattern!r})"
        return Outcome(case_id, plane, "fail", detail, failures, seconds)
    return Outcome(case_id, plane, "divergent", divergence.observed, failures, seconds)


@dataclass(slots=True)
class Ran:
    """What a case that ran to its end left: the failure lines of every step (empty: it
    passed), the runner's notes, the plane's last output lines, and the settings the
    plane substituted while observed."""

    failures: list[str]
    notes: list[str]
    plane_log: str
    substitutions: list[str] = field(default_factory=list)


async def execute_case(case: Case, plane: Plane, options: RunOptions, observe: bool = False) -> Ran:
    """Start the plane's sidecars, the fleet and the plane, drive every step, stop
    everything. Raises CaseError when it cannot run.

    `observe`: the case runs only to be watched (`--run-unsupported`), so the plane may
    substitute settings it lacks (`Launch.substitute`).

    Cancellation: every process of the case (sidecars included) is stopped.
    """
    with tempfile.TemporaryDirectory(prefix="conformance-") as scratch:
        async with (
            open_plane_client() as client,
            open_sidecars(plane.environment(), Path(scratch)) as sidecars,
        ):
            await plane.start_sidecars(sidecars, case)
            opened: AbstractAsyncContextManager[CaseFleet] = (
                options.engine_pool.lend(case)
                if options.engine_pool is not None
                else open_fleet(
                    case,
                    client,
                    options.fake_worker_command,
                    "grpc" if options.fleet in GRPC_FLEETS else "http",
                )
            )
            async with opened as fleet:
                launch = Launch(
                    case, list(fleet), HOST, 0, Path(scratch), sidecars, observe=observe
                )
                await plane.prepare(launch, client)
                async with open_plane(plane, launch, client) as (url, child):
                    run = CaseRun(case, plane, fleet, launch, client, url, child)
                    failures = await drive_steps(run)
                    return Ran(failures, run.notes, child.output.tail(40), launch.substitutions)


@asynccontextmanager
async def open_plane(
    plane: Plane, base: Launch, client: httpx.AsyncClient
) -> AsyncIterator[tuple[str, Child]]:
    """Start the plane in front of the fleet and yield (its URL, its process) once ready.

    A plane that needs a runner-picked port and loses it to another process is started
    again on a new one (twice at most).
    """
    for attempt in range(3):
        port = 0 if plane.listen_pattern is not None else free_port(HOST)
        launch = Launch(
            base.case,
            base.workers,
            base.host,
            port,
            base.workdir,
            base.sidecars,
            base.observe,
            base.substitutions,
        )
        argv = plane.command(launch)
        async with open_process(
            argv,
            f"plane {plane.name}",
            stop_grace_s=plane.stop_grace_s,
            env=dict(plane.launch_environment(launch)),
        ) as child:
            try:
                url = await _wait_ready(plane, launch, child, client)
            except CaseError:
                if attempt < 2 and child.exited and PORT_TAKEN.search(child.output.tail(50)):
                    continue
                raise
            yield url, child
            return


async def _wait_ready(plane: Plane, launch: Launch, child: Child, client: httpx.AsyncClient) -> str:
    """The plane's URL once it serves the fleet; CaseError if it exits or takes too long."""
    url = f"http://{launch.host}:{launch.port}"
    ready = False

    async def watch_exit(cancel: trio.CancelScope) -> None:
        await child.process.wait()
        cancel.cancel()

    async def become_ready(cancel: trio.CancelScope) -> None:
        nonlocal url, ready
        if plane.listen_pattern is not None:
            try:
                match = await child.output.wait_for(plane.listen_pattern)
            except ProcessFailed:
                return  # the exit watcher ends the wait
            url = match.group(1).rstrip("/")
        await plane.wait_ready(client, url, launch)
        ready = True
        cancel.cancel()

    with trio.move_on_after(plane.ready_timeout_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_exit, nursery.cancel_scope)
            nursery.start_soon(become_ready, nursery.cancel_scope)
    if ready:
        return url
    if child.exited:
        raise CaseError(
            f"plane {plane.name} exited ({child.process.returncode}) before it was ready:\n{child.output.tail()}"
        )
    raise CaseError(
        f"plane {plane.name} was not ready within {plane.ready_timeout_s:g}s:\n{child.output.tail()}"
    )


def _join(*parts: str | None) -> str:
    return "; ".join(part for part in parts if part)


# -- the suite ---------------------------------------------------------------------------


async def run_suite(
    cases: Sequence[Case],
    planes: Sequence[Plane],
    divergences: Mapping[str, Mapping[str, Divergence]],
    options: RunOptions,
) -> list[Outcome]:
    """Every case on every plane, `options.jobs` pairs at a time; outcomes in case order.

    On an engine fleet (`vllm`, `vllm-grpc`): one pool of engines, as many as the largest
    fleet, for the whole run; one pair at a time, and the pool restored after each (a
    restart that fails ends the run with EngineUnavailable: the cases after it would only
    meet a broken fleet).
    """
    if options.fleet in ENGINE_FLEETS and options.engine_pool is None:
        size = max(len(case.fleet) for case in cases)
        protocol = "grpc" if options.fleet in GRPC_FLEETS else "http"
        async with open_engine_pool(size, protocol) as pool:
            engines = replace(options, engine_pool=pool, jobs=1)
            return await run_suite(cases, planes, divergences, engines)
    limiter = trio.CapacityLimiter(max(1, options.jobs))
    outcomes: dict[tuple[str, str], Outcome] = {}

    async def one(case: Case, plane: Plane) -> None:
        async with limiter:
            outcome = await run_case(case, plane, divergences.get(plane.name, {}), options)
            if options.engine_pool is not None:
                await options.engine_pool.restore()
        outcomes[(case.id, plane.name)] = outcome
        if options.on_outcome is not None:
            options.on_outcome(outcome)

    async with trio.open_nursery() as nursery:
        for case in cases:
            for plane in planes:
                nursery.start_soon(one, case, plane)
    return [outcomes[(case.id, plane.name)] for case in cases for plane in planes]

"""Run cases against planes: fleet up, plane up, steps driven and checked, all torn down.

Each (case, plane) pair gets its own fleet of fake workers and its own plane process on
ports of their own, so pairs run in parallel (`jobs` at a time) without colliding.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import trio

from conformance.client import Answer, open_plane_client, send_many, send_one
from conformance.dispatch_counts import settled_routing, worker_view
from conformance.divergences import Divergence
from conformance.expect import check_answers, check_workers
from conformance.fleet import FAKE_WORKER_COMMAND, Fleet, FleetError, open_fleet
from conformance.model import (
    AwaitStep,
    Case,
    FleetChangeStep,
    PollStep,
    SendStep,
    SetBehaviourStep,
    WaitStep,
)
from conformance.planes.base import Launch, Plane, Unsupported
from conformance.processes import Child, ProcessFailed, free_port, open_process
from conformance.sidecars import Sidecars, open_sidecars

Verdict = Literal["pass", "fail", "divergent", "unsupported", "stale", "error"]
# Verdicts that make the run exit non-zero.
FAILING: frozenset[str] = frozenset({"fail", "stale", "error"})
HOST = "127.0.0.1"
CASE_TIMEOUT_S = 180.0
# Signs that a plane on a runner-picked port lost the race for it to another process.
PORT_TAKEN = re.compile(r"address already in use|os error 98|EADDRINUSE", re.IGNORECASE)


class CaseError(RuntimeError):
    """The case could not be run to the end: a process died or never became ready."""


# What a case that could not run ends with, rather than a crash of the whole suite.
KNOWN_PROBLEMS: tuple[type[Exception], ...] = (
    CaseError,
    FleetError,
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


# -- one case on one plane ---------------------------------------------------------------


async def run_case(
    case: Case, plane: Plane, divergences: Mapping[str, Divergence], options: RunOptions
) -> Outcome:
    """Run `case` on `plane` and judge it against the plane's known divergences."""
    missing = sorted(case.capabilities_needed() - plane.capabilities)
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
            async with open_fleet(case, client, options.fake_worker_command) as fleet:
                launch = Launch(
                    case, list(fleet), HOST, 0, Path(scratch), sidecars, observe=observe
                )
                await plane.prepare(launch, client)
                async with open_plane(plane, launch, client) as (url, child):
                    run = CaseRun(case, plane, fleet, launch, client, url, child)
                    failures = await drive_steps(run)
                    return Ran(failures, run.notes, child.output.tail(40), launch.substitutions)


@dataclass(slots=True)
class CaseRun:
    """Everything the steps of one running case act on."""

    case: Case
    plane: Plane
    fleet: Fleet
    launch: Launch
    client: httpx.AsyncClient
    url: str
    child: Child
    notes: list[str] = field(default_factory=list)

    def noted(self, label: str, answers: Sequence[Answer]) -> list[Answer]:
        """`answers`, with the notes the client wrote on them kept for the case's record."""
        self.notes += [f"{label}: {note}" for answer in answers for note in answer.notes]
        return list(answers)

    @property
    def sidecars(self) -> Sidecars:
        return self.launch.sidecars


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


async def drive_steps(run: CaseRun) -> list[str]:
    """Every step in order; the failure lines. Background sends run in a nursery of this
    call, so none outlives the case (the schema makes every one awaited)."""
    case, fleet, client = run.case, run.fleet, run.client
    failures: list[str] = []
    start = await settled_routing(fleet, client)
    model = case.default_model
    background: dict[str, tuple[trio.Event, list[Answer]]] = {}

    async def collect(step: SendStep, done: trio.Event, into: list[Answer]) -> None:
        answers = await send_many(client, run.url, step.request, model)
        into += run.noted(step.label, answers)
        done.set()

    async with trio.open_nursery() as nursery:
        for index, step in enumerate(case.steps, 1):
            lines: list[str] = []
            if isinstance(step, WaitStep):
                await trio.sleep(step.seconds)
            elif isinstance(step, SetBehaviourStep):
                await fleet.set_behaviour(client, step.workers, step.behaviour)
            elif isinstance(step, FleetChangeStep):
                await change_fleet(run, step)
            elif isinstance(step, SendStep) and step.request.background is not None:
                done, answers = background[step.request.background] = (trio.Event(), [])
                nursery.start_soon(collect, step, done, answers)
            elif isinstance(step, SendStep):
                before = await settled_routing(fleet, client) if step.expect.reads_workers else None
                answers = await send_many(client, run.url, step.request, model)
                lines = check_answers(step.expect, run.noted(f"step {index} {step.label}", answers))
                if before is not None:
                    after = await settled_routing(fleet, client)
                    lines += check_workers(step.expect, case, worker_view(start, before, after))
            elif isinstance(step, AwaitStep):
                done, answers = background[step.name]
                await done.wait()
                lines = check_answers(step.expect, answers)
            elif isinstance(step, PollStep):
                lines = await poll(run, step, f"step {index} {step.label}")
            failures += [f"step {index} {step.label}: {line}" for line in lines]
            problems = fleet.crashed() + run.sidecars.crashed()
            if run.child.exited:
                problems.append(
                    f"plane exited ({run.child.process.returncode}):\n{run.child.output.tail()}"
                )
            if problems:
                raise CaseError(f"after step {index}: " + "\n".join(problems))
    return failures


async def change_fleet(run: CaseRun, step: FleetChangeStep) -> None:
    """Publish or withdraw records through the plane's discovery backend."""
    for name in step.workers:
        worker = run.fleet.workers[name]
        if step.action == "remove":
            await run.plane.withdraw(run.launch, run.client, worker)
        else:
            status = step.status if step.status is not None else "active"
            await run.plane.publish(run.launch, run.client, worker, status)


async def poll(run: CaseRun, step: PollStep, label: str) -> list[str]:
    deadline = trio.current_time() + step.timeout_s
    while True:
        answer = await send_one(run.client, run.url, step.request, run.case.default_model)
        lines = check_answers(step.expect, run.noted(label, [answer]))
        if not lines:
            return []
        if trio.current_time() >= deadline:
            return [f"not within {step.timeout_s:g}s; last answer: {line}" for line in lines]
        await trio.sleep(step.interval_s)


def _join(*parts: str | None) -> str:
    return "; ".join(part for part in parts if part)


# -- the suite ---------------------------------------------------------------------------


async def run_suite(
    cases: Sequence[Case],
    planes: Sequence[Plane],
    divergences: Mapping[str, Mapping[str, Divergence]],
    options: RunOptions,
) -> list[Outcome]:
    """Every case on every plane, `options.jobs` pairs at a time; outcomes in case order."""
    limiter = trio.CapacityLimiter(max(1, options.jobs))
    outcomes: dict[tuple[str, str], Outcome] = {}

    async def one(case: Case, plane: Plane) -> None:
        async with limiter:
            outcome = await run_case(case, plane, divergences.get(plane.name, {}), options)
        outcomes[(case.id, plane.name)] = outcome
        if options.on_outcome is not None:
            options.on_outcome(outcome)

    async with trio.open_nursery() as nursery:
        for case in cases:
            for plane in planes:
                nursery.start_soon(one, case, plane)
    return [outcomes[(case.id, plane.name)] for case in cases for plane in planes]

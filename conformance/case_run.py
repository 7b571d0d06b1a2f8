"""One running case: what its steps act on (`CaseRun`), and driving them in order
(`drive_steps`), each step's answers checked against its expectations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import trio

from conformance.client import Answer, Progress, send_many, send_one
from conformance.dispatch_counts import settled_routing, worker_view
from conformance.expect import check_answers, check_workers
from conformance.fleet import CaseFleet
from conformance.model import (
    AwaitStep,
    Case,
    FaultStep,
    FleetChangeStep,
    PollStep,
    RequestSpec,
    SendStep,
    SetBehaviourStep,
    StreamingStep,
    WaitStep,
)
from conformance.planes.base import Launch, Plane
from conformance.processes import Child
from conformance.sidecars import Sidecars


class CaseError(RuntimeError):
    """The case could not be run to the end: a process died or never became ready."""


@dataclass(slots=True)
class CaseRun:
    """Everything the steps of one running case act on."""

    case: Case
    plane: Plane
    fleet: CaseFleet
    launch: Launch
    client: httpx.AsyncClient
    url: str
    child: Child
    notes: list[str] = field(default_factory=list)

    def claimed(self, request: RequestSpec) -> RequestSpec:
        """`request` with the headers that make its claims in the plane's words."""
        if request.priority is None:
            return request
        headers = {**request.headers, **self.plane.request_headers(self.launch, request)}
        return dataclasses.replace(request, headers=headers)

    def noted(self, label: str, answers: Sequence[Answer]) -> list[Answer]:
        """`answers`, with the notes the client wrote on them kept for the case's record."""
        self.notes += [f"{label}: {note}" for answer in answers for note in answer.notes]
        return list(answers)

    @property
    def sidecars(self) -> Sidecars:
        return self.launch.sidecars


async def drive_steps(run: CaseRun) -> list[str]:
    """Every step in order; the failure lines. Background sends run in a nursery of this
    call, so none outlives the case (the schema makes every one awaited)."""
    case, fleet, client = run.case, run.fleet, run.client
    failures: list[str] = []
    start = await settled_routing(fleet, client)
    model = case.default_model
    background: dict[str, tuple[trio.Event, list[Answer]]] = {}
    # Per background send: how many of its requests have the first bytes of an answer.
    progress: dict[str, Progress] = {}

    async def collect(
        step: SendStep, done: trio.Event, into: list[Answer], started: Progress
    ) -> None:
        answers = await send_many(client, run.url, run.claimed(step.request), model, started)
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
            elif isinstance(step, FaultStep):
                for name in step.workers:
                    await fleet.fault(name, step.action)
            elif isinstance(step, StreamingStep):
                lines = await streaming(progress[step.name], run.case, step)
            elif isinstance(step, SendStep) and step.request.background is not None:
                done, answers = background[step.request.background] = (trio.Event(), [])
                started = progress[step.request.background] = Progress()
                nursery.start_soon(collect, step, done, answers, started)
            elif isinstance(step, SendStep):
                before = await settled_routing(fleet, client) if step.expect.reads_workers else None
                answers = await send_many(
                    client, target_url(run, step.request), run.claimed(step.request), model
                )
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


def target_url(run: CaseRun, request: RequestSpec) -> str:
    """Where a send goes: the plane, or the fleet worker it names (past the plane)."""
    if request.worker is None:
        return run.url
    return next(worker.url for worker in run.fleet if worker.name == request.worker)


async def streaming(started: Progress, case: Case, step: StreamingStep) -> list[str]:
    """Wait until every request of the background send has the first bytes of its answer."""
    count = next(
        s.request.count
        for s in case.steps
        if isinstance(s, SendStep) and s.request.background == step.name
    )
    with trio.move_on_after(step.timeout_s):
        await started.wait_for(count)
        return []
    return [f"{started.started} of {count} had any answer bytes after {step.timeout_s:g}s"]


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
        answer = await send_one(
            run.client, run.url, run.claimed(step.request), run.case.default_model
        )
        lines = check_answers(step.expect, run.noted(label, [answer]))
        if not lines:
            return []
        if trio.current_time() >= deadline:
            return [f"not within {step.timeout_s:g}s; last answer: {line}" for line in lines]
        await trio.sleep(step.interval_s)

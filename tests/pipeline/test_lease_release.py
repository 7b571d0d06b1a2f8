"""Every lease a request takes is released on every path, mixed and PD, probe or not.

Each test starts with every worker's breaker half-open, so the request's leases are the
probes: a leaked lease would leave a worker "probe in flight" for ever (no request could
probe it again) and its in-flight count one too high. After each path the test asserts
in-flight 0 on every worker and every probe slot free. Virtual time (MockClock); the
upstream is a scripted stand-in, the writer a deliberately broken object where the path
needs one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import pytest
import trio
import trio.testing

from router.cli.config import Settings
from router.cli.serve import failover_settings
from router.fleet.breaker import (
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    Outcome,
    Permit,
    make_breaker,
)
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Fleet
from router.http.server.messages import ClientDisconnected, Headers, Request
from router.http.upstream.exceptions import UpstreamConnectError, UpstreamTimeout
from router.http.upstream.pool import UpstreamPool
from router.observability.metrics import RouterMetrics
from router.pipeline.attempt import Lease
from router.pipeline.service import GenerationService
from tests.support.scripted_upstream import ScriptedResponse

MODEL = "m"
OK_BODY = orjson.dumps({"choices": [{"message": {"content": "hello"}}]})
COOLDOWN_S = 5.0


def chat(**extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})


def deep_chat(depth: int = 300) -> bytes:
    """Valid JSON that orjson parses (limit 1024) and cannot dump again (limit 254)."""
    nested = b"[" * depth + b"]" * depth
    return chat()[:-1] + b',"deep":' + nested + b"}"


@dataclass
class Pool:
    """An `UpstreamPool` stand-in: each URL answers `statuses[url]` (or is refused) after 1 s."""

    behaviour: dict[str, int | str]
    bodies: list[tuple[str, bytes]] = field(default_factory=list)

    @asynccontextmanager
    async def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout_s: float | None = None,
        head_deadline: float = math.inf,
    ) -> AsyncIterator[ScriptedResponse]:
        self.bodies.append((base_url, body))
        # The head is due by its deadline, as the real pool keeps it.
        with trio.move_on_after(max(0.0, head_deadline - trio.current_time())) as head:
            await trio.sleep(1.0)  # the worker's simulated work, in virtual time (autojump clock)
        if head.cancelled_caught:
            raise UpstreamTimeout("no response head by the deadline")
        status = self.behaviour[base_url]
        if status == "refuse":
            raise UpstreamConnectError(f"cannot connect to {base_url}: refused")
        yield ScriptedResponse(int(status), OK_BODY)


@dataclass
class Writer:
    """A response writer; `fail_with` makes every write raise (a client gone, or a bug)."""

    fail_with: BaseException | None = None
    status: int = 0
    body: bytes = b""
    started: bool = False

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        await self.start(status, headers)
        self.body = body

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        await trio.lowlevel.checkpoint()
        if self.fail_with is not None:
            raise self.fail_with
        self.status, self.started = status, True
        self.body += first

    async def write(self, data: bytes) -> None:
        self.body += data

    async def finish(self, last: bytes = b"") -> None:
        self.body += last

    async def abort(self, *, reset: bool = False) -> None:
        pass


MIXED = {"http://mixed-a": Role.MIXED}
PD = {"http://prefill-a": Role.PREFILL, "http://decode-a": Role.DECODE}


def service_over(
    workers: dict[str, Role], behaviour: dict[str, int | str]
) -> tuple[GenerationService, Pool]:
    settings = Settings.defaults(
        breaker_failure_threshold=1, breaker_cooldown_s=COOLDOWN_S, max_attempts=1
    )
    breaker_settings = BreakerSettings(1, COOLDOWN_S, 60.0)
    fleet = Fleet(lambda worker_id: make_breaker(breaker_settings, worker_id))
    for url, role in workers.items():
        fleet.upsert(WorkerRecord(id=url, url=url, models=(MODEL,), role=role, dp_size=2))
    pool = Pool(behaviour)
    metrics = RouterMetrics(fleet)
    return GenerationService(
        failover_settings(settings),
        fleet,
        cast(UpstreamPool, pool),
        metrics.requests,
        metrics.pipeline,
    ), pool


def half_open_every_breaker(service: GenerationService) -> None:
    """Trip each breaker now and let its cooldown pass: the next lease on it is the probe."""
    now = trio.current_time()
    for worker in service.fleet.workers():
        assert worker.breaker is not None
        permit = worker.breaker.acquire(now)
        assert permit is not None
        worker.breaker.record(permit, Outcome.FAULT, now)
    # The caller sleeps past the cooldown.


async def prepared(
    workers: dict[str, Role], behaviour: dict[str, int | str]
) -> tuple[GenerationService, Pool]:
    service, pool = service_over(workers, behaviour)
    half_open_every_breaker(service)
    await trio.sleep(COOLDOWN_S)
    for worker in service.fleet.workers():
        assert worker.breaker is not None
        assert worker.breaker.state(trio.current_time()) is BreakerState.HALF_OPEN
    return service, pool


def assert_every_lease_released(service: GenerationService, *, probes_sent: int) -> None:
    now = trio.current_time()
    for worker in service.fleet.workers():
        assert worker.inflight == 0, worker.id
        assert worker.rank_inflight == [0, 0], worker.id
        assert worker.breaker is not None
        assert not worker.breaker.statistics(now).probe_in_flight, worker.id
    assert probes_sent >= 1


LAYOUTS = pytest.mark.parametrize("workers", [MIXED, PD], ids=["mixed", "pd"])


@LAYOUTS
async def test_a_body_nested_300_deep_is_served_and_leaves_no_lease(
    workers: dict[str, Role], autojump_clock: trio.testing.MockClock
) -> None:
    service, pool = await prepared(workers, dict.fromkeys(workers, 200))
    writer = Writer()
    await service.handle(Request("POST", "/v1/chat/completions", [], deep_chat()), writer)
    assert writer.status == 200
    assert len(pool.bodies) == len(workers)
    assert_every_lease_released(service, probes_sent=len(pool.bodies))
    # The probes succeeded: each breaker closed.
    for worker in service.fleet.workers():
        assert worker.breaker is not None
        assert worker.breaker.state(trio.current_time()) is BreakerState.CLOSED


@LAYOUTS
async def test_cancellation_mid_attempt_releases_every_lease(
    workers: dict[str, Role], autojump_clock: trio.testing.MockClock
) -> None:
    service, pool = await prepared(workers, dict.fromkeys(workers, 200))
    with trio.move_on_after(0.5) as scope:  # the upstream answers after 1 s
        await service.handle(Request("POST", "/v1/chat/completions", [], chat()), Writer())
    assert scope.cancelled_caught
    assert_every_lease_released(service, probes_sent=len(pool.bodies))


@LAYOUTS
async def test_a_client_gone_at_the_answer_releases_every_lease(
    workers: dict[str, Role], autojump_clock: trio.testing.MockClock
) -> None:
    service, pool = await prepared(workers, dict.fromkeys(workers, 200))
    request = Request("POST", "/v1/chat/completions", [], chat())
    await service.handle(request, Writer(fail_with=ClientDisconnected("gone")))
    assert_every_lease_released(service, probes_sent=len(pool.bodies))


@LAYOUTS
async def test_an_upstream_error_releases_every_lease(
    workers: dict[str, Role], autojump_clock: trio.testing.MockClock
) -> None:
    behaviour: dict[str, int | str] = dict.fromkeys(workers, 200)
    behaviour[next(iter(workers))] = "refuse"
    service, pool = await prepared(workers, behaviour)
    writer = Writer()
    await service.handle(Request("POST", "/v1/chat/completions", [], chat()), writer)
    assert writer.status == 502
    assert_every_lease_released(service, probes_sent=len(pool.bodies))


@LAYOUTS
async def test_an_unexpected_exception_releases_every_lease(
    workers: dict[str, Role], autojump_clock: trio.testing.MockClock
) -> None:
    service, pool = await prepared(workers, dict.fromkeys(workers, 200))
    request = Request("POST", "/v1/chat/completions", [], chat())
    with pytest.raises(RuntimeError, match="a bug"):
        await service.handle(request, Writer(fail_with=RuntimeError("a bug")))
    assert_every_lease_released(service, probes_sent=len(pool.bodies))


async def test_a_batch_beyond_max_n_takes_no_lease_and_sends_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    service, pool = await prepared(PD, dict.fromkeys(PD, 200))
    body = orjson.dumps({"model": MODEL, "prompt": ["x"] * 129})
    writer = Writer()
    await service.handle(Request("POST", "/v1/completions", [], body), writer)
    assert writer.status == 400
    assert b"the limit is 128 (--max-n)" in writer.body
    assert pool.bodies == []
    for worker in service.fleet.workers():
        assert worker.inflight == 0
        assert worker.breaker is not None
        assert worker.breaker.state(trio.current_time()) is BreakerState.HALF_OPEN


class BrokenBreaker:
    """A deliberately broken breaker: it grants permits and raises on every verdict."""

    def acquire(self, now: float, *, force: bool = False) -> Permit:
        return Permit(probe=False, forced=False)

    def record(self, permit: Permit, outcome: Outcome, now: float) -> None:
        raise RuntimeError("the verdict failed")


@pytest.mark.pure_only  # a breaker double where the compiled Worker takes only a CircuitBreaker
async def test_a_verdict_that_raises_still_ends_every_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    service, _ = service_over(PD, dict.fromkeys(PD, 200))
    workers = service.fleet.workers()
    for worker in workers:
        worker.breaker = cast(CircuitBreaker, BrokenBreaker())
    leases: list[Lease] = []
    for worker in workers:
        service.runner.take(worker, False, trio.current_time(), 1, leases)
    assert [worker.inflight for worker in workers] == [1, 1]
    with pytest.raises(RuntimeError, match="the verdict failed"):
        service.runner.release_all(leases)
    assert [worker.inflight for worker in workers] == [0, 0]
    assert [worker.rank_inflight for worker in workers] == [[0, 0], [0, 0]]
    assert leases == []

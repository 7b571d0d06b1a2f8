"""The attempt loop and the breaker together, under a mock clock and without sockets.

A scripted pool stands in for the upstream pool: each worker answers after a set virtual
latency with a set status, so the tests can say exactly when, and to whom, every request
was dispatched. The point is where the half-open probe goes: to the recovered worker, the
moment a request is really sent there, never reserved by a request the policy sends
elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import orjson
import pytest
import trio
import trio.testing

from router.cli.config import Settings
from router.cli.serve import failover_settings
from router.fleet.breaker import BreakerSettings, BreakerState, make_breaker
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.http.server.messages import Headers, Request
from router.http.upstream.exceptions import UpstreamConnectError, UpstreamTimeout
from router.http.upstream.pool import UpstreamPool
from router.observability.metrics import RouterMetrics
from router.pipeline.service import GenerationService
from router.policies.policy import PolicyKey
from tests.support.scripted_upstream import ScriptedResponse

MODEL = "m"
CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
OK_BODY = orjson.dumps({"choices": [{"message": {"content": "hello"}}]})
ERROR_BODY = orjson.dumps({"error": {"message": "down", "type": "server_error", "code": 503}})


@dataclass
class Script:
    """How one worker answers: a status (or "refuse") after `latency_s` of virtual time."""

    status: int | str = 200
    latency_s: float = 1.0


class ScriptedPool:
    """An `UpstreamPool` stand-in that records (url, virtual time) of every dispatch."""

    def __init__(self, scripts: dict[str, Script]) -> None:
        self.scripts = scripts
        self.dispatched: list[tuple[str, float]] = []
        self.headers: list[list[tuple[bytes, bytes]]] = []

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
        self.dispatched.append((base_url, trio.current_time()))
        self.headers.append(headers)
        script = self.scripts[base_url]
        # The head is due by its deadline, as the real pool keeps it.
        with trio.move_on_after(max(0.0, head_deadline - trio.current_time())) as head:
            await trio.sleep(script.latency_s)
        if head.cancelled_caught:
            raise UpstreamTimeout("no response head by the deadline")
        if script.status == "refuse":
            raise UpstreamConnectError(f"cannot connect to {base_url}: refused")
        status = int(script.status)
        yield ScriptedResponse(status, OK_BODY if status == 200 else ERROR_BODY)

    def to(self, url: str) -> list[float]:
        """When each dispatch to `url` happened."""
        return [at for target, at in self.dispatched if target == url]


@dataclass
class Answer:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    started: bool = False

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body, self.started = status, list(headers), body, True

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        self.status, self.headers, self.started = status, list(headers), True
        self.body += first

    async def write(self, data: bytes) -> None:
        self.body += data

    async def finish(self, last: bytes = b"") -> None:
        self.body += last

    async def abort(self, *, reset: bool = False) -> None:
        raise AssertionError("the router never drops a client's connection")

    def header(self, name: bytes) -> bytes | None:
        return dict(self.headers).get(name)


class Scripted:
    """A policy that picks the worker ids it is given, in order (then the first candidate)."""

    def __init__(self, picks: Sequence[str]) -> None:
        self.picks = list(picks)

    def pick(self, key: PolicyKey, candidates: Sequence[Worker]) -> Worker:
        if self.picks:
            wanted = self.picks.pop(0)
            for worker in candidates:
                if worker.id == wanted:
                    return worker
        return candidates[0]


@dataclass
class Router:
    service: GenerationService
    pool: ScriptedPool
    fleet: Fleet
    metrics: RouterMetrics

    async def send(self) -> Answer:
        answer = Answer()
        await self.service.handle(Request("POST", "/v1/chat/completions", [], CHAT), answer)
        return answer

    def state(self, url: str) -> BreakerState:
        return self.breaker(url).state(trio.current_time())

    def breaker(self, url: str) -> Any:
        worker = self.fleet.get(url)
        assert worker is not None and worker.breaker is not None
        return worker.breaker


def make_router(scripts: dict[str, Script], **overrides: Any) -> Router:
    """A generation service over workers named by their URLs, with threshold-1 breakers."""
    values: dict[str, Any] = {
        "policy": "round_robin",
        "breaker_failure_threshold": 1,
        "breaker_cooldown_s": 5.0,
        "breaker_max_cooldown_s": 60.0,
        # The attempt loop itself, not the wait before it: a verdict is answered at once.
        "wait_for_workers_s": 0.0,
    }
    values.update(overrides)
    settings = Settings.defaults(**values)
    breaker_settings = BreakerSettings(
        settings.breaker_failure_threshold,
        settings.breaker_cooldown_s,
        settings.breaker_max_cooldown_s,
    )
    fleet = Fleet(lambda worker_id: make_breaker(breaker_settings, worker_id))
    for url in scripts:
        fleet.upsert(WorkerRecord(id=url, url=url, models=(MODEL,)))
    pool = ScriptedPool(scripts)
    metrics = RouterMetrics(fleet)
    service = GenerationService(
        failover_settings(settings),
        fleet,
        cast(UpstreamPool, pool),
        metrics.requests,
        metrics.pipeline,
    )
    return Router(service, pool, fleet, metrics)


A, B = "http://a", "http://b"


async def trip_a(router: Router) -> None:
    """A fails once (threshold 1) and B answers: A is open from t=1 with a 5 s cooldown."""
    script = router.pool.scripts[A]
    router.pool.scripts[A] = Script(503, latency_s=1.0)
    answer = await router.send()
    assert (answer.status, answer.header(b"x-router-worker")) == (200, B.encode())
    assert router.pool.to(A) == [0.0]
    assert router.state(A) is BreakerState.OPEN
    assert router.breaker(A).statistics(trio.current_time()).next_probe_at == 6.0
    router.pool.scripts[A] = script


async def test_cooldown_boundary_is_exact_at_the_service(
    autojump_clock: trio.testing.MockClock,
) -> None:
    router = make_router({A: Script(), B: Script(latency_s=0)})
    await trip_a(router)  # A opened at t=1, when its 503 arrived
    await trio.sleep_until(1 + 5 - 0.001)
    await router.send()
    assert router.pool.to(A) == [0.0]
    await trio.sleep_until(6.0)
    # Round robin over [A, B] reaches A within two requests; B answers instantly, so both
    # are sent at t=6.0 and A's probe is dispatched exactly at the boundary.
    served = [(await router.send()).header(b"x-router-worker") for _ in range(2)]
    assert A.encode() in served
    assert router.pool.to(A) == [0.0, 6.0]
    assert router.state(A) is BreakerState.CLOSED


async def test_a_request_the_policy_sends_elsewhere_does_not_hold_the_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    router = make_router({A: Script(), B: Script(latency_s=0)})
    await trip_a(router)
    await trio.sleep_until(6.0)
    router.pool.scripts[B].latency_s = 10.0
    # The policy's first pick after the cooldown is B, although A is a candidate again.
    router.service.policies[Role.MIXED] = Scripted([B, A])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(router.send)
        await trio.sleep(0.5)
        # B's request is in flight; A is half-open and its probe slot is still free.
        stats = router.breaker(A).statistics(trio.current_time())
        assert (stats.state, stats.probe_in_flight) == (BreakerState.HALF_OPEN, False)
        # The next request the policy sends to A is the probe, dispatched at once.
        answer = await router.send()
    assert answer.header(b"x-router-worker") == A.encode()
    assert router.pool.to(A) == [0.0, 6.5]
    assert router.pool.to(B) == [1.0, 6.0]
    assert router.state(A) is BreakerState.CLOSED


async def test_one_probe_among_fifty_concurrent_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    router = make_router({A: Script(latency_s=2.0), B: Script(latency_s=0)})
    await trip_a(router)
    await trio.sleep_until(6.0)
    answers: list[Answer] = []

    async def send_one() -> None:
        answers.append(await router.send())

    async with trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(send_one)
        await trio.sleep(1.0)
        # Mid-probe: A has had exactly one request, the rest went to B.
        assert router.pool.to(A) == [0.0, 6.0]
        assert router.breaker(A).statistics(trio.current_time()).probe_in_flight
    assert [a.status for a in answers] == [200] * 50
    assert len(router.pool.to(B)) == 1 + 49
    assert router.state(A) is BreakerState.CLOSED


async def test_a_cancelled_probe_frees_the_slot_for_the_next_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    router = make_router({A: Script(latency_s=3.0), B: Script(latency_s=0)})
    await trip_a(router)
    await trio.sleep_until(6.0)
    with trio.move_on_after(1.0):  # the client leaves while the probe is in flight
        await router.send()
    stats = router.breaker(A).statistics(trio.current_time())
    assert (stats.state, stats.probe_in_flight, stats.cooldown_s) == (
        BreakerState.HALF_OPEN,
        False,
        5.0,
    )
    assert router.fleet.get(A) is not None and router.fleet.get(A).inflight == 0  # type: ignore[union-attr]
    # Round robin sends the next request to B; the one after it probes A at once.
    answers = [await router.send(), await router.send()]
    assert [a.header(b"x-router-worker") for a in answers] == [B.encode(), A.encode()]
    assert router.pool.to(A) == [0.0, 6.0, 7.0]
    assert router.state(A) is BreakerState.CLOSED


async def test_failed_probes_double_the_cooldown_at_the_service(
    autojump_clock: trio.testing.MockClock,
) -> None:
    router = make_router(
        {A: Script(latency_s=0), B: Script(latency_s=0)}, breaker_max_cooldown_s=20.0
    )
    await trip_a(router)
    router.pool.scripts[A].status = "refuse"
    probes: list[float] = []
    for cooldown in (10.0, 20.0, 20.0):
        stats = router.breaker(A).statistics(trio.current_time())
        await trio.sleep_until(stats.next_probe_at)
        assert (await router.send()).status == 200
        probes = router.pool.to(A)[1:]
        assert router.breaker(A).statistics(trio.current_time()).cooldown_s == cooldown
    # Opened at 1 with 5 s, then each failed probe re-opens it for twice as long (capped).
    assert probes == [6.0, 16.0, 36.0]


@pytest.mark.parametrize(
    ("wait_s", "retry_after"), [(0.0, "5"), (2.5, "3"), (4.0, "1"), (4.999, "1")]
)
async def test_reject_mode_retry_after_is_whole_seconds_to_the_earliest_probe(
    autojump_clock: trio.testing.MockClock,
    wait_s: float,
    retry_after: str,
) -> None:
    router = make_router(
        {A: Script(status=503, latency_s=0), B: Script(status=503, latency_s=0)},
        breaker_all_open="reject",
    )
    first = await router.send()
    assert first.status == 503 and router.state(A) is router.state(B) is BreakerState.OPEN
    await trio.sleep(wait_s)
    rejected = await router.send()
    assert rejected.status == 503
    assert orjson.loads(rejected.body)["error"]["code"] == "no_available_workers"
    assert rejected.header(b"retry-after") == retry_after.encode()
    assert len(router.pool.dispatched) == 2


@pytest.mark.parametrize(("workers", "retries"), [(1, 0), (2, 1), (3, 2), (4, 2)])
async def test_only_failures_followed_by_another_attempt_count_as_retries(
    autojump_clock: trio.testing.MockClock,
    workers: int,
    retries: int,
) -> None:
    urls = [f"http://w{i}" for i in range(workers)]
    router = make_router(
        {url: Script(status=503, latency_s=0) for url in urls}, breaker_failure_threshold=3
    )
    answer = await router.send()
    assert answer.status == 503
    assert len(router.pool.dispatched) == min(workers, 3)
    registry = router.metrics.registry
    assert (
        registry.get_sample_value("router_retries_total", {"reason": "status_503"}) or 0
    ) == retries


class RankedScript(Scripted):
    """A policy that also names the DP rank of its pick, as kv_aware does."""

    def __init__(self, rank: int | None) -> None:
        super().__init__([])
        self.rank = rank

    def pick_ranked(
        self, key: PolicyKey, candidates: Sequence[Worker]
    ) -> tuple[Worker, int | None]:
        return self.pick(key, candidates), self.rank


@pytest.mark.parametrize(("policy_rank", "dispatched"), [(1, [b"1", b"1"]), (None, [b"0", b"1"])])
async def test_a_policys_own_rank_choice_is_the_rank_dispatched_to(
    autojump_clock: trio.testing.MockClock, policy_rank: int | None, dispatched: list[bytes]
) -> None:
    router = make_router({A: Script(latency_s=0)})
    worker = router.fleet.get(A)
    assert worker is not None
    router.fleet.upsert(replace(worker.record, dp_size=2))
    router.service.policies[Role.MIXED] = RankedScript(policy_rank)
    ranks = []
    for _ in range(2):
        await router.send()
        ranks.append(dict(router.pool.headers[-1]).get(b"x-data-parallel-rank"))
    # The policy's rank both times; without one, the least-loaded rank, in turn.
    assert ranks == dispatched

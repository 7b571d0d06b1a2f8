"""A fleet that empties for a moment is not an unknown model: 503 with Retry-After, not 404.

The classification is pure (`plan_request` takes `now`); the fleet remembers when a model
lost its last worker. Virtual time throughout, boundaries exact.
"""

from __future__ import annotations

from typing import cast

import orjson
import pytest
import trio
import trio.testing

from router.api.errors import ModelNotFound, NoAvailableWorkers
from router.cli.config import Settings
from router.cli.serve import failover_settings
from router.fleet.candidates import AllOpenMode
from router.fleet.records import WorkerRecord
from router.fleet.registry import Fleet
from router.http.server.messages import Headers, Request
from router.http.upstream.pool import UpstreamPool
from router.observability.metrics import RouterMetrics
from router.pipeline.plan import plan_request
from router.pipeline.service import GenerationService

MEMORY_S = 300.0
DISPATCH = AllOpenMode.DISPATCH


def test_a_model_that_left_within_the_memory_is_a_503_and_after_it_a_404() -> None:
    gone_at = 1000.0
    for now in (gone_at, gone_at + MEMORY_S - 0.001):
        with pytest.raises(NoAvailableWorkers) as info:
            plan_request("m", [], now, DISPATCH, 2.0, gone_at, MEMORY_S)
        assert info.value.status == 503
        assert info.value.retry_after_s == 2.0
        assert "no worker right now" in str(info.value)
    with pytest.raises(ModelNotFound):
        plan_request("m", [], gone_at + MEMORY_S, DISPATCH, 2.0, gone_at, MEMORY_S)
    with pytest.raises(ModelNotFound):
        plan_request("never-served", [], gone_at, DISPATCH, 2.0, None, MEMORY_S)
    with pytest.raises(ModelNotFound):
        plan_request("m", [], gone_at, DISPATCH, 2.0, gone_at, 0.0)


def record(worker_id: str, model: str = "m") -> WorkerRecord:
    return WorkerRecord(id=worker_id, url=f"http://{worker_id}.test", models=(model,))


async def test_the_fleet_remembers_when_a_model_lost_its_last_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(model_memory_s=MEMORY_S, clock=trio.current_time)
    fleet.upsert(record("a"))
    fleet.upsert(record("b"))
    await trio.sleep(10)
    fleet.remove("a")
    assert fleet.last_served_at("m") is None  # b still serves it
    await trio.sleep(5)
    fleet.remove("b")
    assert fleet.last_served_at("m") == 15.0
    fleet.upsert(record("b"))
    assert fleet.last_served_at("m") is None  # served again
    fleet.replace_all([])
    assert fleet.last_served_at("m") == 15.0
    assert fleet.remembered_models(15.0 + MEMORY_S - 0.001) == 1
    assert fleet.remembered_models(15.0 + MEMORY_S) == 0
    # A later change prunes what the memory no longer covers: the dict stays bounded.
    await trio.sleep(MEMORY_S)
    fleet.upsert(record("x", model="other"))
    assert fleet.last_served_at("m") is None
    assert fleet.remembered_models(trio.current_time()) == 0


class Writer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.started = False

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body, self.started = status, list(headers), body, True

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        raise AssertionError("nothing streams here")

    async def write(self, data: bytes) -> None:
        raise AssertionError("nothing streams here")

    async def finish(self, last: bytes = b"") -> None:
        assert not last, "nothing streams here"

    async def abort(self, *, reset: bool = False) -> None:
        pass


async def test_a_request_in_the_gap_gets_503_with_retry_after_then_404_after_the_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = Settings.defaults(model_memory_s=MEMORY_S, retry_after_s=3.0, wait_for_workers_s=0.0)
    fleet = Fleet(model_memory_s=MEMORY_S, clock=trio.current_time)
    fleet.upsert(record("a"))
    fleet.upsert(record("z", model="other"))  # so the model must be named, as clients do
    metrics = RouterMetrics(fleet)
    service = GenerationService(
        failover_settings(settings),
        fleet,
        cast(UpstreamPool, None),
        metrics.requests,
        metrics.pipeline,
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})

    async def send() -> Writer:
        writer = Writer()
        await service.handle(Request("POST", "/v1/chat/completions", [], body), writer)
        return writer

    fleet.remove("a")  # at t=0
    await trio.sleep(MEMORY_S - 0.001)
    answer = await send()
    assert answer.status == 503
    assert dict(answer.headers)[b"retry-after"] == b"3"
    assert orjson.loads(answer.body)["error"]["code"] == "no_available_workers"
    await trio.sleep(0.001)
    answer = await send()
    assert answer.status == 404
    assert orjson.loads(answer.body)["error"]["code"] == "model_not_found"

"""The fake gRPC engine's scripted behaviour, as a client meets it: status codes, resets
before and during a stream, silence, garbage, a stream that ends in an error, an unhealthy
engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from router.fake_worker.grpc_engine.service import GARBAGE, GENERATE
from router.fake_worker.grpc_engine.status_codes import code_for_status
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.grpc_engine import Served, run_scenario, serving


def _request(stream: bool = True) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=[3, 3]), stream=stream
    )


async def _collect(
    served: Served, request: pb.GenerateRequest, grpc_deadline_s: float | None = None
) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None]:
    """The replies of one call and the error it ended with (None: it ended well); the
    deadline is the call's own, which the server sees."""
    replies: list[pb.GenerateResponse] = []
    try:
        async for reply in served.stub.Generate(request, timeout=grpc_deadline_s):
            replies.append(reply)
    except grpc.aio.AioRpcError as exc:
        return replies, exc
    return replies, None


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (404, grpc.StatusCode.NOT_FOUND),
        (408, grpc.StatusCode.DEADLINE_EXCEEDED),
        (422, grpc.StatusCode.INTERNAL),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (500, grpc.StatusCode.INTERNAL),
        (503, grpc.StatusCode.UNAVAILABLE),
        (504, grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
def test_a_scripted_status_is_the_servicers_code(
    tmp_path: Path, status: int, code: grpc.StatusCode
) -> None:
    assert code_for_status(status) is code

    async def scenario() -> tuple[Any, Any, int]:
        settings = FakeWorkerSettings(model="m", fail_first=1, fail_status=status)
        async with serving(tmp_path, settings) as served:
            first = await _collect(served, _request())
            second = await _collect(served, _request())
            return first, second, served.engine.routing.failures

    (replies, error), (after, fine), failures = run_scenario(scenario)
    assert replies == [] and error is not None
    assert error.code() is code
    assert error.details() == f"scripted failure: fake worker answers {status}"
    assert fine is None and after[-1].complete.finish_reason == "stop"
    assert failures == 1


def test_fail_first_minus_one_fails_every_generation(tmp_path: Path) -> None:
    async def scenario() -> list[grpc.StatusCode | None]:
        settings = FakeWorkerSettings(model="m", fail_first=-1, fail_status=500)
        async with serving(tmp_path, settings) as served:
            return [(await _collect(served, _request()))[1].code() for _ in range(3)]  # type: ignore[union-attr]

    assert run_scenario(scenario) == [grpc.StatusCode.INTERNAL] * 3


@pytest.mark.parametrize("chunks", [0, 2])
def test_a_reset_cuts_the_connection_after_the_scripted_chunks(tmp_path: Path, chunks: int) -> None:
    async def scenario() -> tuple[list[pb.GenerateResponse], Any, Any, dict[str, Any], int]:
        settings = FakeWorkerSettings(
            model="m", fail_first=1, fail_mode="reset", fail_after_chunks=chunks
        )
        async with serving(tmp_path, settings) as served:
            replies, error = await _collect(served, _request())
            _, again = await _collect(served, _request())  # a new connection serves
            routing = served.engine.routing_json()
            return replies, error, again, routing, served.relay.connections

    replies, error, again, routing, connections = run_scenario(scenario)
    assert again is None
    assert [list(r.chunk.token_ids) for r in replies] == [[4], [5]][:chunks]
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert routing["resets"] == 1 and routing["dispatches"] == 2
    assert connections == 2


def test_hang_answers_nothing_until_the_client_gives_up(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[pb.GenerateResponse], Any, dict[str, Any]]:
        settings = FakeWorkerSettings(model="m", fail_first=-1, fail_mode="hang")
        async with serving(tmp_path, settings) as served:
            replies, error = await _collect(served, _request(), grpc_deadline_s=0.3)
            await served.engine.wait_until(lambda: served.engine.routing.inflight == 0)
            return replies, error, served.engine.routing_json()

    replies, error, routing = run_scenario(scenario)
    assert replies == [] and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert (routing["dispatches"], routing["disconnects"], routing["inflight"]) == (1, 1, 0)


def test_garbage_is_a_message_no_client_can_parse(tmp_path: Path) -> None:
    async def scenario() -> list[bytes]:
        settings = FakeWorkerSettings(model="m", fail_first=1, fail_mode="garbage")
        async with serving(tmp_path, settings) as served:
            unparsed = served.channel.unary_stream(
                GENERATE, request_serializer=pb.GenerateRequest.SerializeToString
            )
            return [reply async for reply in unparsed(_request(stream=False))]

    (garbage,) = run_scenario(scenario)
    assert garbage == GARBAGE
    with pytest.raises(DecodeError):
        pb.GenerateResponse.FromString(garbage)


def test_midstream_sends_its_chunks_then_ends_with_the_scripted_code(tmp_path: Path) -> None:
    async def scenario() -> Any:
        settings = FakeWorkerSettings(
            model="m", fail_first=1, fail_mode="midstream", fail_after_chunks=3, fail_status=500
        )
        async with serving(tmp_path, settings) as served:
            return await _collect(served, _request())

    replies, error = run_scenario(scenario)
    assert [list(r.chunk.token_ids) for r in replies] == [[4], [5], [6]]
    assert error.code() is grpc.StatusCode.INTERNAL


def test_unhealthy_says_so_on_health_check_and_healthy_again_after(tmp_path: Path) -> None:
    async def scenario() -> list[tuple[bool, str]]:
        async with serving(tmp_path) as served:
            seen = []
            for healthy in (False, True):
                served.engine.behaviour.update({"healthy": healthy})
                answer = await served.stub.HealthCheck(pb.HealthCheckRequest())
                seen.append((answer.healthy, answer.message))
            return seen

    assert run_scenario(scenario) == [(False, "scripted unhealthy"), (True, "Health")]


def test_a_concurrency_limit_queues_and_shows_the_queue_in_loads(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int, int]:
        settings = FakeWorkerSettings(model="m", max_concurrency=1, ttft_ms=60_000)
        async with serving(tmp_path, settings) as served:
            calls = [served.stub.Generate(_request()) for _ in range(3)]
            reads = [asyncio.ensure_future(call.read()) for call in calls]
            load = served.engine.routing.loads[0]
            await served.engine.wait_until(lambda: load.running + load.queued == 3)
            loads = (await served.stub.GetLoads(pb.GetLoadsRequest())).loads[0]
            for call in calls:
                call.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            return loads.num_running_reqs, loads.num_waiting_reqs, loads.max_running_requests

    assert run_scenario(scenario) == (1, 2, 1)

"""The gRPC pool against the fake gRPC engine on loopback: one connection per worker
carrying many calls, statuses read verbatim, a cancelled call reset (the engine sees
its client leave), a broken connection replaced, the call cap a local shortage."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from router.http.grpc import (
    GrpcBroken,
    GrpcConnectError,
    GrpcPoolSettings,
    GrpcStatusError,
    StatusCode,
    open_grpc_pool,
)
from router.http.upstream.exceptions import LocalShortage
from router.http.upstream.pool import open_upstream_pool
from tests.support.grpc_fake_process import FakeGrpcEngine, fake_grpc_engine

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
MODEL_INFO = "/vllm.grpc.engine.VllmEngine/GetModelInfo"
GUARD_S = 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGrpcEngine]:
    with fake_grpc_engine(tmp_path_factory.mktemp("model"), "--model", "m", "--tokens", "4") as e:
        yield e


def generate(ids: list[int], *, request_id: str = "r", stream: bool = True) -> bytes:
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream
    ).SerializeToString()


async def test_many_calls_share_one_connection(engine: FakeGrpcEngine) -> None:
    await engine.behave()
    counts: list[int] = []
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            info = pb.GetModelInfoResponse.FromString(
                await pool.unary(
                    engine.url, MODEL_INFO, pb.GetModelInfoRequest().SerializeToString()
                )
            )

            async def one(k: int) -> None:
                seen = 0
                async with pool.call(
                    engine.url, GENERATE, generate([5, 6], request_id=f"c{k}")
                ) as call:
                    while (message := await call.receive_message()) is not None:
                        pb.GenerateResponse.FromString(message)
                        seen += 1
                counts.append(seen)

            async with trio.open_nursery() as nursery:
                for k in range(50):
                    nursery.start_soon(one, k)
            stats = pool.statistics()
    assert info.served_model_name == "m"
    assert counts == [5] * 50  # four chunks and the complete, each call
    assert (stats.opened, stats.connections, stats.calls_open) == (1, 1, 0)
    assert (await engine.routing())["dispatches"] == 50


async def test_a_refused_request_is_its_status_and_message_verbatim(engine: FakeGrpcEngine) -> None:
    await engine.behave()
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            async with pool.call(engine.url, GENERATE, generate([])) as call:
                with pytest.raises(GrpcStatusError) as refused:
                    await call.receive_message()
    assert refused.value.code is StatusCode.INVALID_ARGUMENT
    assert refused.value.message == "The decoder prompt cannot be empty"


@pytest.mark.parametrize(("status", "code"), [(503, "UNAVAILABLE"), (429, "RESOURCE_EXHAUSTED")])
async def test_a_scripted_status_reaches_the_caller(
    engine: FakeGrpcEngine, status: int, code: str
) -> None:
    await engine.behave(fail_first=1, fail_status=status)
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            async with pool.call(engine.url, GENERATE, generate([5])) as call:
                with pytest.raises(GrpcStatusError) as failed:
                    await call.receive_message()
    assert failed.value.code is StatusCode[code]
    assert failed.value.message == f"scripted failure: fake worker answers {status}"


async def test_a_cancelled_call_is_reset_and_the_connection_stays(engine: FakeGrpcEngine) -> None:
    await engine.behave(fail_first=1, fail_mode="hang")
    connections = (await engine.routing())["connections"]
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            with trio.move_on_after(0.5) as waited:
                async with pool.call(engine.url, GENERATE, generate([5])) as call:
                    await call.receive_message()
            assert waited.cancelled_caught
            while (await engine.routing())["disconnects"] < 1:  # noqa: ASYNC110 - a counter
                await trio.sleep(0.05)
            async with pool.call(engine.url, GENERATE, generate([5])) as call:
                while await call.receive_message() is not None:
                    pass
            stats = pool.statistics()
    assert (stats.opened, stats.calls_open) == (1, 0)
    routing = await engine.routing()
    assert (routing["disconnects"], routing["dispatches"]) == (1, 2)
    assert routing["connections"] == connections + 1


async def test_a_reset_connection_fails_its_calls_and_the_next_call_reconnects(
    engine: FakeGrpcEngine,
) -> None:
    await engine.behave(fail_first=1, fail_mode="reset", fail_after_chunks=1)
    received: list[bytes] = []
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            async with pool.call(engine.url, GENERATE, generate([5])) as call:
                with pytest.raises(GrpcBroken):
                    while (message := await call.receive_message()) is not None:
                        received.append(message)
            async with pool.call(engine.url, GENERATE, generate([5])) as call:
                while await call.receive_message() is not None:
                    pass
            stats = pool.statistics()
    assert len(received) == 1  # the chunk before the reset
    assert (stats.opened, stats.closed) == (2, 1)


async def test_a_worker_not_listening_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            with pytest.raises(
                GrpcConnectError, match=f"cannot connect to grpc://127.0.0.1:{port}"
            ):
                await pool.unary(f"grpc://127.0.0.1:{port}", MODEL_INFO, b"")
            stats = pool.statistics()
    assert (stats.opened, stats.calls_open) == (0, 0)


async def test_a_call_beyond_the_cap_waits_then_is_a_local_shortage(
    engine: FakeGrpcEngine,
) -> None:
    await engine.behave(fail_first=1, fail_mode="hang")
    with trio.fail_after(GUARD_S):
        async with open_grpc_pool(GrpcPoolSettings(max_calls_per_worker=1)) as pool:
            async with pool.call(engine.url, GENERATE, generate([5])):
                with pytest.raises(LocalShortage, match="all 1 are open"):
                    await pool.unary(engine.url, MODEL_INFO, b"", connect_timeout_s=0.2)
                assert pool.statistics().calls_waiting == 0
            assert pool.statistics().calls_open == 0


async def test_a_grpc_url_is_refused_by_the_http_pool() -> None:
    async with open_upstream_pool() as http_pool:
        with pytest.raises(ValueError, match="gRPC worker"):
            async with http_pool.request(
                "grpc://127.0.0.1:5000", "POST", "/v1/completions", [], b""
            ):
                pass
        assert http_pool.statistics().opened == 0

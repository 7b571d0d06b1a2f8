"""The fake gRPC engine's service, as a router over gRPC calls it: every RPC the SGLang
gateway calls, the answers' shapes, and what vLLM refuses."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from router.fake_worker.grpc_engine.service import GENERATE, SERVICE
from router.fake_worker.grpc_engine.tokenizer_files import EOS_ID, FILES, VOCAB_SIZE
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.grpc_engine import RecordedPauses, run_scenario, serving


def _request(
    ids: list[int] | None = None,
    *,
    stream: bool = False,
    max_tokens: int | None = None,
    rank: int | None = None,
    n: int = 0,
    request_id: str = "r1",
) -> pb.GenerateRequest:
    params = pb.SamplingParams(n=n)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    request = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[3, 3, 3] if ids is None else ids),
        sampling_params=params,
        stream=stream,
    )
    if rank is not None:
        request.data_parallel_rank = rank
    return request


def test_a_unary_generation_is_one_complete_with_every_token(tmp_path: Path) -> None:
    async def scenario() -> list[pb.GenerateResponse]:
        async with serving(tmp_path, FakeWorkerSettings(model="m", tokens=4)) as served:
            return [reply async for reply in served.stub.Generate(_request())]

    (reply,) = run_scenario(scenario)
    complete = reply.complete
    assert list(complete.output_ids) == [4, 5, 6, 7]  # tok0 .. tok3
    assert complete.finish_reason == "stop"
    assert (complete.prompt_tokens, complete.completion_tokens) == (3, 4)


def test_a_stream_is_a_chunk_per_token_then_a_complete_repeating_the_last(
    tmp_path: Path,
) -> None:
    async def scenario() -> list[pb.GenerateResponse]:
        async with serving(tmp_path) as served:
            call = served.stub.Generate(_request(stream=True, max_tokens=3))
            return [reply async for reply in call]

    replies = run_scenario(scenario)
    assert [r.WhichOneof("response") for r in replies] == ["chunk"] * 3 + ["complete"]
    assert [list(r.chunk.token_ids) for r in replies[:3]] == [[4], [5], [6]]
    assert all(r.chunk.completion_tokens == 1 for r in replies[:3])
    last = replies[-1].complete
    assert (list(last.output_ids), last.finish_reason, last.completion_tokens) == ([6], "length", 1)


def test_n_choices_stream_interleaved_and_complete_each(tmp_path: Path) -> None:
    async def scenario() -> list[pb.GenerateResponse]:
        async with serving(tmp_path) as served:
            call = served.stub.Generate(_request(stream=True, max_tokens=2, n=2))
            return [reply async for reply in call]

    replies = run_scenario(scenario)
    assert [(r.WhichOneof("response"), r.chunk.index or r.complete.index) for r in replies] == [
        ("chunk", 0),
        ("chunk", 1),
        ("chunk", 0),
        ("chunk", 1),
        ("complete", 0),
        ("complete", 1),
    ]


def test_health_model_and_server_info_describe_the_fake(tmp_path: Path) -> None:
    async def scenario() -> tuple[pb.HealthCheckResponse, pb.GetModelInfoResponse, Any]:
        settings = FakeWorkerSettings(model="m", dp_size=2, max_concurrency=5)
        async with serving(tmp_path, settings) as served:
            health = await served.stub.HealthCheck(pb.HealthCheckRequest())
            model = await served.stub.GetModelInfo(pb.GetModelInfoRequest())
            server = await served.stub.GetServerInfo(pb.GetServerInfoRequest())
            return health, model, server

    health, model, server = run_scenario(scenario)
    assert health.healthy and health.message == "Health"
    assert model.served_model_name == "m"
    assert Path(model.tokenizer_path) == tmp_path / "model"
    assert sorted(p.name for p in Path(model.tokenizer_path).iterdir()) == sorted(FILES)
    assert (model.vocab_size, list(model.eos_token_ids)) == (VOCAB_SIZE, [EOS_ID])
    assert model.max_context_length == 2048 and model.is_generation
    assert (server.data_parallel_size, server.max_num_seqs) == (2, 5)


def test_loads_report_each_dp_rank_with_its_running_requests(tmp_path: Path) -> None:
    async def scenario() -> tuple[pb.GetLoadsResponse, pb.GetLoadsResponse, dict[str, int]]:
        async with serving(tmp_path, FakeWorkerSettings(model="m", dp_size=2)) as served:
            served.engine.behaviour.update({"ttft_ms": 60_000})
            call = served.stub.Generate(_request(rank=1))
            started = asyncio.ensure_future(call.initial_metadata())
            await served.engine.wait_until(lambda: served.engine.routing.loads[1].running == 1)
            everything = await served.stub.GetLoads(pb.GetLoadsRequest())
            one = await served.stub.GetLoads(pb.GetLoadsRequest(dp_rank=1))
            call.cancel()
            await asyncio.gather(started, return_exceptions=True)
            return everything, one, dict(served.engine.routing.ranks)

    everything, one, ranks = run_scenario(scenario)
    assert [(load.dp_rank, load.num_running_reqs) for load in everything.loads] == [(0, 0), (1, 1)]
    assert everything.dp_rank_count == 2
    assert [(load.dp_rank, load.num_running_reqs) for load in one.loads] == [(1, 1)]
    assert ranks == {"1": 1}


def test_the_tokenizer_streams_as_one_zip_with_its_digest_last(tmp_path: Path) -> None:
    async def scenario() -> list[common_pb2.GetTokenizerChunk]:
        async with serving(tmp_path) as served:
            return [c async for c in served.stub.GetTokenizer(common_pb2.GetTokenizerRequest())]

    chunks = run_scenario(scenario)
    data = b"".join(chunk.data for chunk in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(chunk.sha256 == "" for chunk in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        assert sorted(bundle.namelist()) == sorted(FILES)
        assert bundle.read("tokenizer.json") == (tmp_path / "model" / "tokenizer.json").read_bytes()


def test_abort_ends_a_running_stream_with_finish_reason_abort(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[pb.GenerateResponse], int, list[str]]:
        settings = FakeWorkerSettings(model="m", tokens=1000, token_latency_ms=50)
        async with serving(tmp_path, settings) as served:
            call = served.stub.Generate(_request(stream=True, request_id="long"))
            replies = [await call.read()]
            await served.stub.Abort(pb.AbortRequest(request_ids=["long", "unknown"]))
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
            return replies, served.engine.aborts, list(served.engine.aborted)

    replies, aborts, aborted = run_scenario(scenario)
    assert replies[-1].complete.finish_reason == "abort"
    assert list(replies[-1].complete.output_ids) == []
    assert len(replies) < 100
    assert (aborts, aborted) == (2, ["long", "unknown"])


def test_time_to_first_token_and_token_latency_pace_the_stream(tmp_path: Path) -> None:
    pauses = RecordedPauses()

    async def scenario() -> int:
        settings = FakeWorkerSettings(model="m", tokens=3, ttft_ms=250, token_latency_ms=40)
        async with serving(tmp_path, settings, pause=pauses) as served:
            return len([r async for r in served.stub.Generate(_request(stream=True))])

    assert run_scenario(scenario) == 4
    assert pauses.seconds == [0.25, 0.04, 0.04]


def test_health_says_loading_until_the_startup_delay_has_passed(tmp_path: Path) -> None:
    clock = [100.0]

    async def scenario() -> list[tuple[bool, str]]:
        settings = FakeWorkerSettings(model="m", startup_delay_s=5)
        answers = []
        async with serving(tmp_path, settings, now=lambda: clock[0]) as served:
            for at in (100.0, 104.999, 105.0):
                clock[0] = at
                health = await served.stub.HealthCheck(pb.HealthCheckRequest())
                answers.append((health.healthy, health.message))
        return answers

    assert run_scenario(scenario) == [
        (False, "still loading"),
        (False, "still loading"),
        (True, "Health"),
    ]


@pytest.mark.parametrize(
    ("refused", "message"),
    [
        (_request([]), "The decoder prompt cannot be empty"),
        (pb.GenerateRequest(request_id="none"), "The decoder prompt cannot be empty"),
        (_request([5, VOCAB_SIZE]), f"Token id {VOCAB_SIZE} is out of vocabulary"),
        (_request(max_tokens=0), "max_tokens must be at least 1, got 0."),
        (
            _request([3] * 2049),
            "The decoder prompt (length 2049) is longer than the maximum model length of 2048.",
        ),
        (_request(rank=1), "data_parallel_rank 1 is out of range [0, 1)."),
        (_request(n=129), "n must be at most 128, got 129."),
    ],
)
def test_what_vllm_refuses_is_invalid_argument(
    tmp_path: Path, refused: pb.GenerateRequest, message: str
) -> None:
    async def scenario() -> grpc.aio.AioRpcError:
        async with serving(tmp_path) as served:
            try:
                async for _ in served.stub.Generate(refused):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert served.engine.routing.dispatches == 1
                return exc
            raise AssertionError("the request was served")

    error = run_scenario(scenario)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in (error.details() or "")


def test_a_limit_beyond_the_context_is_cut_to_what_it_holds(tmp_path: Path) -> None:
    async def scenario() -> pb.GenerateResponse:
        async with serving(tmp_path, FakeWorkerSettings(model="m", max_model_len=10)) as served:
            (reply,) = [r async for r in served.stub.Generate(_request(max_tokens=5000))]
            return reply

    complete = run_scenario(scenario).complete
    assert (complete.completion_tokens, complete.finish_reason) == (7, "length")


def test_a_text_prompt_counts_its_words(tmp_path: Path) -> None:
    async def scenario() -> pb.GenerateResponse:
        async with serving(tmp_path) as served:
            request = pb.GenerateRequest(request_id="t", text="hello, world tok1")
            (reply,) = [r async for r in served.stub.Generate(request)]
            return reply

    assert run_scenario(scenario).complete.prompt_tokens == 4


def test_a_malformed_message_is_internal_and_an_unknown_method_unimplemented(
    tmp_path: Path,
) -> None:
    def raw(channel: grpc.aio.Channel, method: str, streaming: bool):  # type: ignore[no-untyped-def]
        make = channel.unary_stream if streaming else channel.unary_unary
        return make(f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None)

    async def scenario() -> list[tuple[grpc.StatusCode, str]]:
        seen = []
        async with serving(tmp_path) as served:
            for method, streaming in (("Generate", True), ("GetLoads", False), ("Embed", False)):
                call = raw(served.channel, method, streaming)(b"\xff\xff\xff")
                try:
                    if streaming:
                        async for _ in call:
                            pass
                    else:
                        await call
                except grpc.aio.AioRpcError as exc:
                    seen.append((exc.code(), exc.details() or ""))
            assert served.engine.routing.paths[GENERATE] == 1
        return seen

    (generate, loads, embed) = run_scenario(scenario)
    assert generate[0] is grpc.StatusCode.INTERNAL
    assert "cannot parse vllm.grpc.engine.GenerateRequest" in generate[1]
    assert loads[0] is grpc.StatusCode.INTERNAL
    assert "cannot parse vllm.grpc.engine.GetLoadsRequest" in loads[1]
    assert embed[0] is grpc.StatusCode.UNIMPLEMENTED


def test_another_engines_service_is_unimplemented_so_a_router_knows_the_kind(
    tmp_path: Path,
) -> None:
    # A router asks each engine service's HealthCheck at once to learn the engine's kind.
    async def scenario() -> grpc.StatusCode:
        async with serving(tmp_path) as served:
            probe = served.channel.unary_unary(
                "/sglang.grpc.scheduler.SglangScheduler/HealthCheck",
                request_serializer=None,
                response_deserializer=None,
            )
            try:
                await probe(b"")
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            raise AssertionError("another engine's service answered")

    assert run_scenario(scenario) is grpc.StatusCode.UNIMPLEMENTED


def test_every_call_is_counted_by_its_method(tmp_path: Path) -> None:
    async def scenario() -> dict[str, int]:
        async with serving(tmp_path) as served:
            await served.stub.HealthCheck(pb.HealthCheckRequest())
            await served.stub.HealthCheck(pb.HealthCheckRequest())
            await served.stub.GetModelInfo(pb.GetModelInfoRequest())
            await served.stub.FlushCache(common_pb2.FlushCacheRequest())
            [_ async for _ in served.stub.Generate(_request())]
            return dict(served.engine.routing.paths)

    assert run_scenario(scenario) == {
        f"/{SERVICE}/HealthCheck": 2,
        f"/{SERVICE}/GetModelInfo": 1,
        f"/{SERVICE}/FlushCache": 1,
        GENERATE: 1,
    }

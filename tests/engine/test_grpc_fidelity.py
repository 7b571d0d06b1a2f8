"""The fake gRPC engine held to a real one: vLLM 0.32 serving its gRPC service
(`smg-grpc-servicer` 0.14.1, the tiny model) and `router fake-worker --protocol grpc`,
asked the same things, compared in structure, never in generated tokens.

What is compared per case: the kinds of the messages each choice gets (chunks, then one
`complete`), how many tokens each carries, the finish reason and the counts; for a
refused request, its status code. The deliberate differences are asserted as such: a
malformed message (the fake answers INTERNAL, the servicer UNKNOWN) and KV events (the
fake publishes none). The table is printed (`-rP`) and docs/fake-worker.md keeps the
reviewed facts.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import trio
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from conformance.engines import Engine, EngineSettings
from conformance.processes import open_process
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import ROUTER_CLI

MODEL = "m"
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0
ROWS: list[tuple[str, str]] = []


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    yield from host_engines(
        [EngineSettings(served_model_name=MODEL, protocol="grpc")], name="grpc-fidelity"
    )


@pytest.fixture(scope="module", autouse=True)
def fidelity_table() -> Iterator[None]:
    yield
    lines = ["| case | real vLLM over gRPC and the fake |", "|---|---|"]
    lines += [f"| {case} | {verdict} |" for case, verdict in ROWS]
    print("\nthe fake gRPC engine against vLLM's servicer:\n" + "\n".join(lines))


@pytest.fixture
def engine(host: EngineHost) -> Engine:
    return host.engines[0]


@pytest.fixture
async def fake() -> AsyncIterator[str]:
    argv = [*ROUTER_CLI, "fake-worker", "--protocol", "grpc", "--model", MODEL, "--tokens", "8"]
    async with open_process(argv, "fake-grpc", stop_grace_s=5.0) as child:
        with trio.fail_after(START_TIMEOUT_S):
            match = await child.output.wait_for(re.compile(r"listening on grpc://(\S+)"))
        yield match.group(1)


@dataclass(frozen=True, slots=True)
class Seen:
    """One call as a router meets it: per choice, its messages' kinds and token counts and
    the final complete's finish reason and counts; or the status it failed with."""

    choices: dict[int, list[tuple[str, int, tuple[int, ...] | None]]]
    """Per choice, each message's kind, token count and, where it carries logprobs, how
    many alternatives each of its tokens has."""
    finish: dict[int, tuple[str, int, int]]
    code: grpc.StatusCode | None = None


def _call(target: str, request: pb.GenerateRequest) -> Seen:
    with grpc.insecure_channel(target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        choices: dict[int, list[tuple[str, int, tuple[int, ...] | None]]] = {}
        finish: dict[int, tuple[str, int, int]] = {}
        try:
            for reply in stub.Generate(request, timeout=CALL_TIMEOUT_S):
                if reply.HasField("chunk"):
                    chunk = reply.chunk
                    choices.setdefault(chunk.index, []).append(
                        ("chunk", len(chunk.token_ids), _logprobs(chunk))
                    )
                else:
                    done = reply.complete
                    choices.setdefault(done.index, []).append(
                        ("complete", len(done.output_ids), _logprobs(done))
                    )
                    finish[done.index] = (
                        done.finish_reason,
                        done.prompt_tokens,
                        done.completion_tokens,
                    )
        except grpc.RpcError as exc:
            return Seen({}, {}, exc.code())
        return Seen(choices, finish)


def _logprobs(message: Any) -> tuple[int, ...] | None:
    """The alternatives per token of a message's `output_logprobs`, one entry per token
    with a logprob; None when it carries none."""
    if not message.HasField("output_logprobs"):
        return None
    logprobs = message.output_logprobs
    tops = [len(top.values) for top in logprobs.top_logprobs]
    return tuple(tops[k] if k < len(tops) else 0 for k in range(len(logprobs.token_ids)))


def _request(
    ids: list[int],
    *,
    stream: bool = False,
    max_tokens: int | None = 3,
    n: int = 0,
    logprobs: int | None = None,
    **more: Any,
) -> pb.GenerateRequest:
    params = pb.SamplingParams(n=n, ignore_eos=True)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if logprobs is not None:
        params.logprobs = logprobs
    return pb.GenerateRequest(
        request_id="fidelity",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=params,
        stream=stream,
        **more,
    )


CASES: dict[str, pb.GenerateRequest] = {
    "unary, max_tokens 3": _request([5, 6]),
    "streamed, max_tokens 3": _request([5, 6], stream=True),
    "streamed, n 2": _request([5, 6], stream=True, n=2, max_tokens=2),
    "unary, n 2": _request([5, 6], n=2, max_tokens=2),
    "streamed, logprobs 2": _request([5, 6], stream=True, logprobs=2),
    "unary, logprobs 0": _request([5, 6], logprobs=0),
    "unary, logprobs 3": _request([5, 6], logprobs=3),
    "max_tokens beyond the context": _request([5, 6], max_tokens=5000),
    "max_tokens 0": _request([5, 6], max_tokens=0),
    "empty prompt": _request([]),
    "token id out of the vocabulary": _request([5, 99999]),
    "prompt longer than the context": _request([5] * 2050),
    "data_parallel_rank 3 of 1": _request([5, 6], data_parallel_rank=3),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_generate_answers_alike(engine: Engine, fake: str, name: str) -> None:
    request = CASES[name]
    real_target = engine.url.removeprefix("grpc://")
    with trio.fail_after(2 * CALL_TIMEOUT_S):
        real = await trio.to_thread.run_sync(_call, real_target, request)
        ours = await trio.to_thread.run_sync(_call, fake, request)
    ROWS.append((name, "same" if real == ours else f"differs: vLLM {real}; fake {ours}"))
    assert ours == real


async def test_health_model_info_and_loads_carry_what_a_router_reads(
    engine: Engine, fake: str
) -> None:
    def facts(target: str) -> dict[str, Any]:
        with grpc.insecure_channel(target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
            model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
            return {
                "healthy": (health.healthy, health.message),
                "model": (model.served_model_name, model.is_generation, model.max_context_length),
                "tokenizer": bool(model.tokenizer_path),
                "eos": len(model.eos_token_ids) > 0,
                "dp": server.data_parallel_size,
                "max_num_seqs": server.max_num_seqs,
                "loads": [(load.dp_rank, load.num_running_reqs) for load in loads.loads],
            }

    with trio.fail_after(60):
        real = await trio.to_thread.run_sync(facts, engine.url.removeprefix("grpc://"))
        ours = await trio.to_thread.run_sync(facts, fake)
    ROWS.append(
        (
            "HealthCheck, GetModelInfo, GetServerInfo, GetLoads",
            "same" if real == ours else f"differs: {real} / {ours}",
        )
    )
    assert ours == real


async def test_the_known_differences_are_still_the_ones_documented(
    engine: Engine, fake: str
) -> None:
    def status(target: str, call: Callable[[grpc.Channel], Any]) -> grpc.StatusCode:
        with grpc.insecure_channel(target) as channel:
            try:
                call(channel)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    def malformed(channel: grpc.Channel) -> Any:
        raw = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
        return list(raw(b"\xff\xff\xff\xff", timeout=10))

    def kv_events(channel: grpc.Channel) -> Any:
        subscribe = channel.unary_stream(
            "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
            request_serializer=common_pb2.SubscribeKvEventsRequest.SerializeToString,
            response_deserializer=common_pb2.KvEventBatch.FromString,
        )
        return list(subscribe(common_pb2.SubscribeKvEventsRequest(), timeout=2))

    real_target = engine.url.removeprefix("grpc://")
    with trio.fail_after(60):
        seen = {
            "malformed": (
                await trio.to_thread.run_sync(status, real_target, malformed),
                await trio.to_thread.run_sync(status, fake, malformed),
            ),
            "kv events": (
                await trio.to_thread.run_sync(status, real_target, kv_events),
                await trio.to_thread.run_sync(status, fake, kv_events),
            ),
        }
    ROWS.append(("a malformed GenerateRequest", f"differs as documented: {seen['malformed']}"))
    ROWS.append(("SubscribeKvEvents", f"differs as documented: {seen['kv events']}"))
    assert seen["malformed"] == (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    # The servicer streams (nothing happens within the 2 s deadline); the fake has none.
    assert seen["kv events"] == (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED)

"""What a `grpc://` worker says of itself, over vLLM's engine service
(`vllm.grpc.engine.VllmEngine`, the published `smg-grpc-proto` messages, the `grpc`
extra): health (`HealthCheck`), the served model, its tokenizer's directory and context
(`GetModelInfo`), its DP size (`GetServerInfo`), its load per DP rank (`GetLoads`, read
by the load reader as `/metrics` is for an HTTP worker), and `Abort` for a generation
whose client left.

A gRPC worker's record learns its facts here instead of over HTTP: the models when the
record names none, `engine` (`vllm`: the service is vLLM's), `dp_size`, `max_model_len`
and the tokenizer's directory (kept as the model's root, as vLLM's `/v1/models` `root`
is for an HTTP worker). A gRPC engine states no KV-event publishers in its answers.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import trio

from router.engines.load_readings import RankReading
from router.fleet.records import WorkerRecord
from router.http.grpc import GrpcError, GrpcPool
from router.http.upstream.exceptions import LocalShortage

SERVICE = "/vllm.grpc.engine.VllmEngine/"
GENERATE = SERVICE + "Generate"
ABORT = SERVICE + "Abort"
HEALTH_CHECK = SERVICE + "HealthCheck"
MODEL_INFO = SERVICE + "GetModelInfo"
SERVER_INFO = SERVICE + "GetServerInfo"
LOADS = SERVICE + "GetLoads"

GRPC_EXTRA_HINT = (
    "grpc:// workers need the published engine messages: pip install 'trio-router[grpc]'"
)


class GrpcMessagesMissing(RuntimeError):
    """`smg-grpc-proto` is not installed: no gRPC worker can be used."""


def messages() -> Any:
    """vLLM's engine messages (`vllm_engine_pb2`), imported on first use; raises
    GrpcMessagesMissing without the `grpc` extra."""
    try:
        module: ModuleType = importlib.import_module("smg_grpc_proto.generated.vllm_engine_pb2")
    except ImportError:
        raise GrpcMessagesMissing(GRPC_EXTRA_HINT) from None
    return module


def messages_installed() -> bool:
    try:
        messages()
    except GrpcMessagesMissing:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """`GetModelInfo`, as the router reads it."""

    served_model_name: str
    tokenizer_path: str
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    is_generation: bool


class GrpcFactsUnavailable(Exception):
    """The worker did not answer what was asked (message says why)."""


async def model_info(pool: GrpcPool, url: str, timeout_s: float) -> ModelInfo:
    pb = messages()
    answer = _parse(
        pb.GetModelInfoResponse,
        await _unary(pool, url, MODEL_INFO, pb.GetModelInfoRequest(), timeout_s),
        url,
    )
    return ModelInfo(
        served_model_name=answer.served_model_name,
        tokenizer_path=answer.tokenizer_path or answer.model_path,
        max_context_length=answer.max_context_length,
        eos_token_ids=tuple(answer.eos_token_ids),
        is_generation=answer.is_generation,
    )


async def data_parallel_size(pool: GrpcPool, url: str, timeout_s: float) -> int:
    pb = messages()
    answer = _parse(
        pb.GetServerInfoResponse,
        await _unary(pool, url, SERVER_INFO, pb.GetServerInfoRequest(), timeout_s),
        url,
    )
    return max(1, int(answer.data_parallel_size))


async def scheduler_loads(pool: GrpcPool, url: str, timeout_s: float) -> dict[int, RankReading]:
    """Each DP rank's running and waiting requests and KV usage (`GetLoads`); raises
    GrpcFactsUnavailable when the engine does not answer."""
    pb = messages()
    answer = _parse(
        pb.GetLoadsResponse,
        await _unary(pool, url, LOADS, pb.GetLoadsRequest(), timeout_s),
        url,
    )
    return {
        int(load.dp_rank): RankReading(
            float(load.num_running_reqs), float(load.num_waiting_reqs), float(load.token_usage)
        )
        for load in answer.loads
    }


async def healthy(pool: GrpcPool, url: str, timeout_s: float) -> bool:
    """One `HealthCheck`: its `healthy` field; any failure to answer is unhealthy."""
    pb = messages()
    try:
        answer = _parse(
            pb.HealthCheckResponse,
            await _unary(pool, url, HEALTH_CHECK, pb.HealthCheckRequest(), timeout_s),
            url,
        )
    except GrpcFactsUnavailable:
        return False
    return bool(answer.healthy)


async def abort(pool: GrpcPool, url: str, request_ids: Sequence[str], timeout_s: float) -> bool:
    """Ask the engine to stop generating `request_ids`; whether it said it did."""
    pb = messages()
    try:
        await _unary(pool, url, ABORT, pb.AbortRequest(request_ids=list(request_ids)), timeout_s)
    except GrpcFactsUnavailable:
        return False
    return True


async def learn_grpc_facts(pool: GrpcPool, record: WorkerRecord, timeout_s: float) -> WorkerRecord:
    """`record` with every fact it leaves open answered by its gRPC engine (its
    `unknown_facts` emptied); raises GrpcFactsUnavailable when the engine cannot say."""
    info = await model_info(pool, record.url, timeout_s)
    if not info.served_model_name:
        raise GrpcFactsUnavailable(f"{record.url} names no served model (GetModelInfo)")
    unknown = record.unknown_facts
    changes: dict[str, Any] = {"unknown_facts": frozenset()}
    if "models" in unknown or not record.models:
        changes["models"] = (info.served_model_name,)
    if "dp_size" in unknown:
        changes["dp_size"] = await data_parallel_size(pool, record.url, timeout_s)
    if "engine" in unknown:
        changes["engine"] = "vllm"
    if "max_model_len" in unknown:
        models = changes.get("models", record.models)
        changes["max_model_len"] = {model: info.max_context_length for model in models}
        changes["model_roots"] = {model: info.tokenizer_path for model in models}
    if "kv_event_sources" in unknown:
        changes["kv_event_sources"] = ()
    return dataclasses.replace(record, **changes)


async def _unary(pool: GrpcPool, url: str, method: str, request: Any, timeout_s: float) -> bytes:
    with trio.move_on_after(timeout_s) as deadline:
        try:
            return await pool.unary(
                url, method, request.SerializeToString(), connect_timeout_s=timeout_s
            )
        except (GrpcError, LocalShortage) as exc:
            raise GrpcFactsUnavailable(f"{url} {method.rsplit('/', 1)[-1]}: {exc}") from None
    assert deadline.cancelled_caught
    raise GrpcFactsUnavailable(
        f"{url} {method.rsplit('/', 1)[-1]}: no answer within {timeout_s:g}s"
    )


def _parse(kind: Any, raw: bytes, url: str) -> Any:
    try:
        return kind.FromString(raw)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise GrpcFactsUnavailable(
            f"{url} answered a {kind.DESCRIPTOR.name} that does not parse: {exc}"
        ) from None

"""Whether a gRPC engine answers `HealthCheck` healthy: the readiness probe of a real vLLM
engine serving its gRPC service (`--fleet vllm-grpc`).

grpcio's blocking client in a worker thread (`trio.to_thread`): grpcio has no trio API,
and one call every quarter second while an engine starts costs nothing worth a client of
our own. Imported only by a run that starts gRPC engines, which checks first that grpcio
and smg-grpc-proto are there (`conformance.environment`).
"""

from __future__ import annotations

import trio

ENGINE_SERVICES = ("vllm.grpc.engine.VllmEngine",)


def _healthy(target: str, timeout_s: float) -> bool:
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            answer = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(answer.healthy)


async def grpc_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the engine at `url` (`grpc://HOST:PORT`) says it is healthy within
    `timeout_s`. Cancellation: the thread is left to finish its bounded call."""
    target = url.removeprefix("grpc://")
    return await trio.to_thread.run_sync(_healthy, target, timeout_s, abandon_on_cancel=True)

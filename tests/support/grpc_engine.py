"""The fake gRPC engine in the test's own process: grpcio's asyncio server on a loopback
port (behind the connection relay, as the command runs it) and a client channel to it.

grpcio's server and client run on asyncio, so these tests are plain functions that run
one asyncio scenario each (`run_scenario`), bounded by `SCENARIO_TIMEOUT_S`. Time is
injected where the fake waits: `pause` (time to first token, between tokens) and `now`
(the start-up delay).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from router.fake_worker.grpc_engine.relay import ConnectionRelay
from router.fake_worker.grpc_engine.service import FakeVllmEngine, Pause, pause_unless_aborted
from router.fake_worker.grpc_engine.tokenizer_files import write_model_dir
from router.fake_worker.settings import FakeWorkerSettings

SCENARIO_TIMEOUT_S = 20.0
T = TypeVar("T")


def run_scenario(scenario: Callable[[], Awaitable[T]]) -> T:
    """Run one asyncio scenario to its end, failing after SCENARIO_TIMEOUT_S."""

    async def bounded() -> T:
        async with asyncio.timeout(SCENARIO_TIMEOUT_S):
            return await scenario()

    return asyncio.run(bounded())


@dataclass(slots=True)
class RecordedPauses:
    """A `pause` that returns at once and keeps what it was asked to wait."""

    seconds: list[float] = field(default_factory=list)

    async def __call__(self, seconds: float, aborted: asyncio.Event) -> None:
        self.seconds.append(seconds)
        await asyncio.sleep(0)


@dataclass(slots=True)
class Served:
    engine: FakeVllmEngine
    channel: grpc.aio.Channel
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    relay: ConnectionRelay
    port: int


@asynccontextmanager
async def serving(
    tmp_path: Path,
    settings: FakeWorkerSettings | None = None,
    *,
    pause: Pause = pause_unless_aborted,
    now: Callable[[], float] | None = None,
) -> AsyncIterator[Served]:
    """A fake gRPC engine and a channel to it; everything closed on the way out."""
    settings = settings or FakeWorkerSettings(model="m")
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    inner = server.add_insecure_port("127.0.0.1:0")
    relay = ConnectionRelay(inner)
    engine = FakeVllmEngine(
        settings, write_model_dir(tmp_path / "model"), relay, pause=pause, now=now
    )
    server.add_generic_rpc_handlers((engine.rpc_handler(),))
    await server.start()
    try:
        port = await relay.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(engine, channel, vllm_engine_pb2_grpc.VllmEngineStub(channel), relay, port)
    finally:
        await relay.close()
        await server.stop(0)

"""The gRPC client's own cost: `Generate` streams against the fake gRPC engine.

    python -m bench.grpc_client [--client h2|grpcio-trio-asyncio] [--calls 32]
        [--tokens 64] [--rounds 20] [--idle 10000]

Two figures, both the client process's CPU only (the fake runs in its own process):

- streaming: `--calls` Generate streams at once, `--tokens` messages each, `--rounds`
  times; CPU per streamed message and per one-message call (a `--tokens 1` round);
- idle: `--idle` streams opened and left waiting (the fake's first token is an hour
  away); the client's resident memory and CPU per second while they are held.

`h2` is `router.http.grpc` on trio. `grpcio-trio-asyncio` is grpcio's asyncio API run
under trio through trio-asyncio's bridge (not a dependency of the project: install it
beside the run, e.g. `pip install --target /tmp/ta trio-asyncio` and add the directory to
`PYTHONPATH`). docs/performance.md ("The gRPC upstream") keeps the figures.
"""

from __future__ import annotations

import argparse
import importlib
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def _request(tokens: int, request_id: str) -> bytes:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8]),
        sampling_params=pb.SamplingParams(max_tokens=tokens),
        stream=True,
    ).SerializeToString()


class Fake:
    """`router fake-worker --protocol grpc`, in its own process."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "fake-worker", "--protocol", "grpc", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().split()[-1]
        self.debug = self.process.stdout.readline().split()[-1]

    def inflight(self) -> int:
        return int(httpx.get(self.debug + "/debug/routing", timeout=120).json()["inflight"])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


Stream = Callable[[str, bytes], Awaitable[int]]


async def _rounds(stream: Stream, url: str, calls: int, tokens: int, rounds: int) -> float:
    """CPU seconds of the client over `rounds` of `calls` concurrent streams."""
    started = time.process_time()
    for r in range(rounds):
        async with trio.open_nursery() as nursery:
            for c in range(calls):
                nursery.start_soon(stream, url, _request(tokens, f"b{r}-{c}"))
    return time.process_time() - started


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _measure(open_stream: Callable[[trio.Nursery], Stream], args: argparse.Namespace) -> None:
    fake = Fake("--model", "m", "--tokens", "1")
    try:
        async with trio.open_nursery() as outer:
            stream = open_stream(outer)
            await _rounds(stream, fake.url, args.calls, 4, 2)  # warm up
            per_call = await _rounds(stream, fake.url, args.calls, 1, args.rounds)
            many = await _rounds(stream, fake.url, args.calls, args.tokens, args.rounds)
            total_calls = args.calls * args.rounds
            # Each call carries `tokens` chunks and one complete.
            message_us = (many - per_call) / (total_calls * (args.tokens - 1)) * 1e6
            print(f"{args.client}: {per_call / total_calls * 1e6:.0f} us per one-token call")
            print(f"{args.client}: {message_us:.1f} us per streamed message")
            outer.cancel_scope.cancel()
    finally:
        fake.stop()
    if not args.idle:
        return
    fake = Fake("--model", "m", "--tokens", "1", "--ttft-ms", "3600000")
    try:
        before = _rss_mib()
        failed = 0

        async def held(stream: Stream, c: int) -> None:
            nonlocal failed
            try:
                await stream(fake.url, _request(1, f"idle-{c}"))
            except Exception:  # the server's cancellation of a held stream: counted
                failed += 1

        async with trio.open_nursery() as outer:
            stream = open_stream(outer)
            for c in range(args.idle):
                outer.start_soon(held, stream, c)
            while await trio.to_thread.run_sync(fake.inflight) + failed < args.idle:  # noqa: ASYNC110 - the fake's counter
                await trio.sleep(0.5)
            cpu, wall = time.process_time(), time.monotonic()
            await trio.sleep(5)
            held = (time.process_time() - cpu) / (time.monotonic() - wall)
            print(
                f"{args.client}: {args.idle - failed} idle streams held ({failed} cancelled "
                "by the server), "
                f"{_rss_mib() - before:.0f} MiB more resident, {held * 100:.1f}% CPU while idle"
            )
            outer.cancel_scope.cancel()
    finally:
        fake.stop()


def _h2(nursery: trio.Nursery) -> Stream:
    from router.http.grpc.pool import GrpcPool, GrpcPoolSettings

    pool = GrpcPool(nursery, GrpcPoolSettings(max_calls_per_worker=20000))

    async def stream(url: str, request: bytes) -> int:
        count = 0
        async with pool.call(url, GENERATE, request) as call:
            while await call.receive_message() is not None:
                count += 1
        return count

    return stream


async def _grpcio_trio_asyncio(args: argparse.Namespace) -> None:
    trio_asyncio: Any = importlib.import_module("trio_asyncio")
    grpc: Any = importlib.import_module("grpc")
    channels: dict[str, Any] = {}

    def open_stream(nursery: trio.Nursery) -> Stream:
        async def stream(url: str, request: bytes) -> int:
            target = url.removeprefix("grpc://")
            channel = channels.get(target)
            if channel is None:
                channel = channels[target] = grpc.aio.insecure_channel(target)
            call = channel.unary_stream(GENERATE)(request)
            count = 0
            async for _ in trio_asyncio.aio_as_trio(call):
                count += 1
            return count

        return stream

    async with trio_asyncio.open_loop():
        await _measure(open_stream, args)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_client")
    parser.add_argument("--client", choices=("h2", "grpcio-trio-asyncio"), default="h2")
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--idle", type=int, default=0)
    args = parser.parse_args()
    if args.client == "h2":
        trio.run(_measure, _h2, args)
    else:
        trio.run(_grpcio_trio_asyncio, args)


if __name__ == "__main__":
    main()

"""`router fake-worker --protocol grpc`: one fake gRPC engine as a process, until a signal.

Why asyncio and not trio, in this process only: the engine's gRPC service is served by
grpcio, the server vLLM's own servicer runs on, so what a router meets here (HTTP/2
framing, flow control, status trailers, how a call ends) is what it meets on a real
engine; grpcio's server runs on asyncio (or on threads), not on trio. A trio server of
our own would be one more gRPC implementation for the router to be judged against.
Nothing here is imported by the router's request path.

What it prints, one line each (the conformance runner reads them):

    fake-worker listening on grpc://127.0.0.1:PORT
    fake-worker debug on http://127.0.0.1:DEBUG_PORT

Exit status: 0 after SIGTERM/SIGINT (the first lets calls in flight finish within
`--shutdown-grace-s`, a second stops at once), 3 when a port cannot be bound.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.fake_worker.grpc_engine.debug_http import start_debug_server
from router.fake_worker.grpc_engine.relay import ConnectionRelay
from router.fake_worker.grpc_engine.service import FakeVllmEngine
from router.fake_worker.grpc_engine.tokenizer_files import write_model_dir
from router.fake_worker.settings import FakeWorkerSettings

EXIT_BIND_FAILED = 3


@dataclass(frozen=True, slots=True)
class GrpcOptions:
    """What only the gRPC fake takes beyond `FakeWorkerSettings`."""

    debug_port: int = 0
    """The side port of `/debug/*` (0: any free port)."""
    model_dir: str = ""
    """Where to write the tokenizer files `GetModelInfo` names; empty: a temporary
    directory, removed at exit."""


def unsupported(settings: FakeWorkerSettings) -> str | None:
    """What the gRPC fake cannot be asked to be, or None: a PD role (the gRPC fake serves
    mixed generation only), a model's tokenizer for the prefix cache, a ZMQ port for KV
    events (they stream over `SubscribeKvEvents`), LoRA adapters. `--kv-events` without
    `--cache-tokens` is the settings' own refusal."""
    if settings.role != "mixed":
        return f"--role {settings.role}: the gRPC fake serves mixed generation only"
    if settings.tokenizer:
        return "--tokenizer is not served over gRPC"
    if settings.kv_events_port:
        return (
            "--kv-events-port is not served over gRPC: with --kv-events the gRPC fake "
            "streams its KV events over SubscribeKvEvents on its own port"
        )
    if settings.serves_lora:
        return "--lora-adapters and --runtime-lora-updating are not served over gRPC"
    return None


@contextmanager
def model_directory(options: GrpcOptions, max_model_len: int) -> Iterator[Path]:
    """The directory `GetModelInfo` names, its tokenizer files written: `--model-dir`, or
    a temporary directory removed on the way out."""
    if options.model_dir:
        yield write_model_dir(Path(options.model_dir), max_model_len).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="fake-grpc-model-") as scratch:
        yield write_model_dir(Path(scratch), max_model_len).resolve()


async def serve(settings: FakeWorkerSettings, options: GrpcOptions) -> int:
    """Serve until a signal; the exit status."""
    with model_directory(options, settings.max_model_len) as model_dir:
        return await _serve(settings, options, model_dir)


async def _serve(settings: FakeWorkerSettings, options: GrpcOptions, model_dir: Path) -> int:
    relay: ConnectionRelay | None = None
    # grpcio binds with SO_REUSEPORT unless told not to; its port is private anyway.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    first, second = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (second if first.is_set() else first).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    try:
        inner_port = server.add_insecure_port("127.0.0.1:0")
        relay = ConnectionRelay(inner_port)
        engine = FakeVllmEngine(settings, model_dir, relay)
        server.add_generic_rpc_handlers((engine.rpc_handler(),))
        await server.start()
        try:
            port = await relay.start(settings.host, settings.port)
            debug = await start_debug_server(engine, settings.host, options.debug_port)
        except OSError as exc:
            print(f"router fake-worker: cannot listen on {settings.host}: {exc}", file=sys.stderr)
            return EXIT_BIND_FAILED
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        debug_port = debug.sockets[0].getsockname()[1]
        print(f"fake-worker listening on grpc://{host}:{port}", flush=True)
        print(f"fake-worker debug on http://{host}:{debug_port}", flush=True)
        await first.wait()
        debug.close()
        # Calls in flight get the grace; a second signal ends them at once.
        graceful = asyncio.ensure_future(server.stop(settings.shutdown_grace_s))
        hurry = asyncio.ensure_future(second.wait())
        await asyncio.wait({graceful, hurry}, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        await server.stop(0)
        await asyncio.gather(graceful, hurry, return_exceptions=True)
        return 0
    finally:
        if relay is not None:
            await relay.close()
        await server.stop(0)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def run_grpc(settings: FakeWorkerSettings, options: GrpcOptions) -> int:
    return asyncio.run(serve(settings, options))

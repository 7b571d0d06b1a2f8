"""`router fake-worker`: run one fake engine from the command line until SIGTERM or SIGINT.

`--protocol grpc` serves the engine's gRPC service instead of its HTTP API
(`router.fake_worker.grpc_engine`, which needs the `grpc` extra).

Exit status: 0 after a signal, 2 for bad arguments, 3 when the port cannot be bound, 4
when `--protocol grpc` lacks its packages (the line says what to install).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

import trio

from router.fake_worker.behaviour import FailMode
from router.fake_worker.engine import FakeWorker, serve_fake_worker
from router.fake_worker.registration import (
    FakeRegistration,
    add_registration_arguments,
    register_and_drain,
    registration_options,
)
from router.fake_worker.settings import (
    ENGINES,
    PD_PROTOCOLS,
    ROLES,
    FakeWorkerSettings,
    publisher_settings,
)
from router.fake_worker.vocabulary import write_tokenizer

EXIT_BIND_FAILED = 3
EXIT_MISSING_PACKAGES = 4
PROTOCOLS = ("http", "grpc")
# The top-level modules of the `grpc` extra (protobuf's is `google`).
GRPC_PACKAGES = frozenset({"grpc", "smg_grpc_proto", "google"})
GRPC_PACKAGES_HINT = (
    "router fake-worker: --protocol grpc needs grpcio and smg-grpc-proto: "
    "pip install 'trio-router[grpc]'"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router fake-worker",
        description="A GPU-free inference engine for tests, demos, conformance and benchmarks.",
    )
    where = parser.add_argument_group("where and what")
    where.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    where.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    where.add_argument("--model", default="fake-model", help="served model id")
    where.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="http",
        help="http: the engines' HTTP APIs; grpc: vLLM's gRPC engine service (default http)",
    )
    where.add_argument("--engine", choices=ENGINES, default="sglang", help="API and metric names")
    where.add_argument("--role", choices=ROLES, default="mixed", help="PD role")
    where.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks")
    where.add_argument("--pd-protocol", choices=PD_PROTOCOLS, default="mooncake")
    where.add_argument(
        "--bootstrap-port", type=int, default=8998, help="advertised only; nothing listens there"
    )
    where.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="vLLM's context length: the bound on max_tokens (--engine vllm; default 2048)",
    )
    where.add_argument(
        "--max-concurrency", type=int, default=0, help="running requests at most; 0 = unlimited"
    )
    where.add_argument(
        "--startup-delay-s", type=float, default=0.0, help="/health answers 503 this long"
    )
    where.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=5.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may finish",
    )
    pace = parser.add_argument_group("generation")
    pace.add_argument("--tokens", type=int, default=16, help="tokens when a request sets none")
    pace.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    pace.add_argument("--token-latency-ms", type=float, default=0.0, help="time between tokens")
    pace.add_argument(
        "--embedding-dim",
        type=int,
        default=16,
        help="floats per vector of /v1/embeddings and /pooling",
    )
    pace.add_argument(
        "--cache-tokens",
        type=int,
        default=0,
        help="prefix cache capacity in prompt tokens (LRU, 16-token blocks); 0 = off",
    )
    pace.add_argument(
        "--tokenizer",
        default="",
        metavar="MODEL_DIR",
        help="count the prefix cache in this model's tokens (its tokenizer.json and chat template, as vLLM renders them), as a router's --kv-tokenizer does; default: 4 bytes a token",
    )
    pace.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="time to first token grows by this per prompt token not found in the cache",
    )
    pace.add_argument(
        "--kv-events",
        action="store_true",
        help="publish the prefix cache's KV events as vLLM does (ZMQ PUB and replay ROUTER on ports the kernel picks, listed on /kv_event_sources)",
    )
    pace.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help="publish them on this port instead (replay on port + 1); implies --kv-events; 0 = the kernel's choice",
    )
    gauges = parser.add_argument_group("load gauges")
    gauges.add_argument(
        "--gauge-step-ms",
        type=float,
        default=0.0,
        help="the load gauges (/metrics, /v1/loads, the load stream) refresh once per step of this length and show the step before, as an engine's lag; 0 = live",
    )
    gauges.add_argument(
        "--load-events",
        action="store_true",
        help="publish the load as SGLang's --load-publish-endpoint does (ZMQ PUB per DP rank on consecutive ports, in /server_info's kv_events block); --engine sglang only",
    )
    gauges.add_argument(
        "--external-load",
        type=int,
        default=0,
        help="requests another sender holds on this engine, shown in its running gauge",
    )
    gauges.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="GET /load answers the requests in the server (with --external-load), live, as vLLM's flag of the same name makes it; without it /load answers 0, as vLLM's does; --engine vllm only",
    )
    lora = parser.add_argument_group("LoRA adapters (--engine vllm)")
    lora.add_argument(
        "--lora-adapters",
        type=_names,
        default=(),
        metavar="A,B",
        help="LoRA adapters the engine holds, as vLLM's --lora-modules: listed in /v1/models with parent, served by name (comma-separated)",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="adapters run at once, as vLLM's; requests for another wait for a slot (default 1)",
    )
    lora.add_argument(
        "--runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    )
    fail = parser.add_argument_group("scripted failures")
    fail.add_argument(
        "--fail-first",
        type=int,
        default=0,
        help="first N requests of any model route fail; -1 = all",
    )
    fail.add_argument("--fail-status", type=int, default=503, help="status for --fail-mode status")
    fail.add_argument("--fail-mode", choices=[m.value for m in FailMode], default="status")
    fail.add_argument(
        "--fail-after-chunks", type=int, default=0, help="data events before a midstream break"
    )
    over_grpc = parser.add_argument_group("over gRPC (--protocol grpc)")
    over_grpc.add_argument(
        "--debug-port", type=int, default=0, help="the side port of /debug/*; 0 picks a free one"
    )
    over_grpc.add_argument(
        "--model-dir",
        default="",
        help="where to write the tokenizer files GetModelInfo names (default: a temporary directory)",
    )
    add_registration_arguments(parser)
    parser.add_argument(
        "--write-tokenizer",
        default="",
        metavar="PATH",
        help="write the fake's vocabulary as a tokenizer.json at PATH (token k reads `tok{k} `), for a router's --kv-tokenizer, and exit",
    )
    return parser


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_command(argv: list[str]) -> tuple[FakeWorkerSettings, FakeRegistration | None]:
    """Flags to settings and registration; exits with status 2 and a usage message on
    anything invalid."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Every settings field has the flag of the same name (dashes for underscores).
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FakeWorkerSettings)}
        return FakeWorkerSettings(**values), registration_options(args)
    except ValueError as exc:
        parser.error(str(exc))


def parse_settings(argv: list[str]) -> FakeWorkerSettings:
    """The settings of `argv` (see `parse_command`)."""
    return parse_command(argv)[0]


async def run(settings: FakeWorkerSettings, registration: FakeRegistration | None = None) -> int:
    """Serve until a signal and return the exit status: the first signal lets in-flight
    requests finish (up to the grace), a second one stops at once. A registered worker
    first drains and deregisters (see `register_and_drain`), still serving meanwhile."""
    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            try:
                url = await nursery.start(_serve, settings, shutdown, nursery.cancel_scope)
            except OSError as exc:
                print(
                    f"router fake-worker: cannot listen on {settings.host}:{settings.port}: {exc}",
                    file=sys.stderr,
                )
                return EXIT_BIND_FAILED
            print(f"fake-worker listening on {url}", flush=True)
            if registration is not None:
                await register_and_drain(registration, settings, url, signals)
                shutdown.set()
            async for _ in signals:
                if shutdown.is_set():
                    nursery.cancel_scope.cancel()
                    break
                shutdown.set()
    return 0


async def _serve(
    settings: FakeWorkerSettings,
    shutdown: trio.Event,
    done: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve, then end the command once the server returned after a graceful shutdown."""
    worker = FakeWorker(settings)
    try:
        async with trio.open_nursery() as nursery:
            if settings.publishes_kv_events and worker.prefix_cache is not None:
                # Imported only here: ZMQ and the KV-event code cost a fake worker that
                # publishes nothing a third of its start (a conformance run starts hundreds).
                from router.fake_worker.kv_publisher import KvEventPublisher, serve_kv_publisher

                publisher = await nursery.start(
                    serve_kv_publisher,
                    worker.prefix_cache,
                    KvEventPublisher(publisher_settings(settings)),
                )
                worker.kv_endpoints = (publisher.endpoint, publisher.replay_endpoint)
                print(
                    f"fake-worker publishing KV events on {publisher.endpoint}, "
                    f"replay on {publisher.replay_endpoint}",
                    flush=True,
                )
            if settings.load_events:
                from router.fake_worker.load_publisher import serve_load_publisher

                base = await nursery.start(serve_load_publisher, worker)
                print(
                    f"fake-worker publishing its load on ports {base}-{base + settings.dp_size - 1}",
                    flush=True,
                )
            await serve_fake_worker(
                settings, worker=worker, shutdown=shutdown, task_status=task_status
            )
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A port that cannot be bound (the server's or the publisher's) is the command's
        # own clear error, as it is without the publisher's nursery around the server.
        bind_failures, rest = group.split(OSError)
        if bind_failures is not None and rest is None:
            raise _first_leaf(bind_failures) from None
        raise
    done.cancel()


def _first_leaf(group: BaseExceptionGroup[OSError]) -> OSError:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, OSError)
    return leaf


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.write_tokenizer:
        print(write_tokenizer(Path(args.write_tokenizer)), flush=True)
        return 0
    if args.protocol == "grpc":
        return _main_grpc(argv, args)
    return trio.run(run, *parse_command(argv))


def _main_grpc(argv: list[str], args: argparse.Namespace) -> int:
    """The gRPC fake: its own process, on grpcio's asyncio server."""
    settings, registration = parse_command(argv)
    try:
        from router.fake_worker.grpc_engine.main import GrpcOptions, run_grpc, unsupported
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in GRPC_PACKAGES:
            raise
        print(GRPC_PACKAGES_HINT, file=sys.stderr)
        return EXIT_MISSING_PACKAGES
    problem = unsupported(settings)
    if registration is not None:
        problem = "--register is not served over gRPC"
    if problem is not None:
        build_parser().error(problem)
    return run_grpc(settings, GrpcOptions(args.debug_port, args.model_dir))

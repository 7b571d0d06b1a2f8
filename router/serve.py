"""`router serve`: the router process, and `run_router` which tests and the demo embed.

`run_router` owns the root nursery: discovery, health checks, the upstream pool's
sweeper, then the HTTP server. Each starts with `nursery.start`, so the router reports
ready only when all of them are.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import httpx
import trio
from prometheus_client import CollectorRegistry

from router.app import RouterApp
from router.breaker import BreakerSettings, BreakerState, make_breaker
from router.config import ConfigError, Settings, add_arguments, load_settings
from router.discovery import DiscoveryHealth
from router.discovery.static import serve_static_discovery
from router.health import serve_health_checks
from router.http.pool import PoolSettings, open_upstream_pool
from router.http.server import serve_http
from router.http.server_settings import ServerSettings
from router.metrics import RouterMetrics
from router.workers import BreakerFactory, Fleet

log = logging.getLogger("router")
EXIT_BAD_SETTINGS = 2
EXIT_BIND_FAILED = 3


class CannotListen(Exception):
    """The HTTP server could not bind its address (in use, not local, not resolvable)."""


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(slots=True)
class RunningRouter:
    port: int
    app: RouterApp

    @property
    def url(self) -> str:
        return http_url(self.app.settings.host, self.port)

    @property
    def fleet(self) -> Fleet:
        return self.app.fleet

    @property
    def metrics(self) -> RouterMetrics:
        return self.app.metrics


def _breaker_factory(settings: Settings, metrics_ref: list[RouterMetrics]) -> BreakerFactory:
    breaker_settings = BreakerSettings(
        failure_threshold=settings.breaker_failure_threshold,
        cooldown_s=settings.breaker_cooldown_s,
        max_cooldown_s=settings.breaker_max_cooldown_s,
    )

    def on_transition(name: str, old: BreakerState, new: BreakerState, now: float) -> None:
        if new is BreakerState.OPEN:
            # A trip is an outage beginning (closed -> open), as `/v1/workers` counts it; a
            # failed probe extends the outage and shows in the state gauge and the log.
            if old is BreakerState.CLOSED:
                metrics_ref[0].breaker_trips.labels(name).inc()
            log.warning("breaker of %s opened (was %s)", name, old.name.lower())
        elif new is BreakerState.HALF_OPEN:
            # The probe itself is logged when it is dispatched (router.failover).
            log.debug("breaker of %s is half-open: the next request to it is the probe", name)
        else:
            log.info("breaker of %s closed: the worker recovered", name)

    return lambda worker_id: make_breaker(breaker_settings, worker_id, on_transition)


def server_settings(settings: Settings) -> ServerSettings:
    return ServerSettings(
        host=settings.host,
        port=settings.port,
        max_body_bytes=settings.max_body_bytes,
        max_connections=settings.max_connections,
        header_timeout_s=settings.header_timeout_s,
        idle_timeout_s=settings.idle_timeout_s,
        shutdown_grace_s=settings.shutdown_grace_s,
        reuse_port=settings.reuse_port,
    )


async def run_router(
    settings: Settings,
    *,
    shutdown: trio.Event | None = None,
    registry: CollectorRegistry | None = None,
    task_status: trio.TaskStatus[RunningRouter] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the router until `shutdown` is set (then drain gracefully) or cancelled.

    Reports a `RunningRouter` once discovery, health checks and the HTTP server are all
    up. Raises `CannotListen` when the address cannot be bound.
    Cancellation: every connection, upstream or client, is closed at once.
    """
    shutdown = shutdown if shutdown is not None else trio.Event()
    metrics_ref: list[RouterMetrics] = []
    fleet = Fleet(_breaker_factory(settings, metrics_ref))
    metrics = RouterMetrics(fleet, registry)
    metrics_ref.append(metrics)
    pool_settings = PoolSettings(
        max_idle_per_worker=settings.pool_max_idle_per_worker,
        idle_expiry_s=settings.pool_idle_expiry_s,
        max_connections_per_worker=settings.max_connections_per_worker,
    )
    async with (
        open_upstream_pool(pool_settings) as pool,
        httpx.AsyncClient(timeout=settings.health_timeout_s) as http,
        trio.open_nursery() as nursery,
    ):
        metrics.watch_pool(pool)
        discovery: DiscoveryHealth = await nursery.start(
            partial(serve_discovery, settings, fleet, http, metrics)
        )
        await nursery.start(
            partial(
                serve_health_checks, fleet, http,
                interval_s=settings.health_interval_s,
                timeout_s=settings.health_timeout_s,
                failure_threshold=settings.health_failure_threshold,
                success_threshold=settings.health_success_threshold,
            )
        )
        app = RouterApp(settings, fleet, pool, metrics, discovery)

        serve = serve_http
        if settings.server == "hypercorn":
            from router.http.asgi import serve_asgi

            serve = serve_asgi

        async def serve_until_drained(*, task_status: trio.TaskStatus[int]) -> None:
            await serve(app.handle, server_settings(settings), shutdown=shutdown, task_status=task_status)
            nursery.cancel_scope.cancel()

        try:
            port = await nursery.start(serve_until_drained)
        except OSError as exc:
            raise CannotListen(f"cannot listen on {settings.host}:{settings.port}: {exc}") from exc
        # Operators and scripts read the bound URL from this line (with --port 0 it is
        # the only place the port shows up).
        log.info("router listening on %s with %d workers", http_url(settings.host, port), len(fleet))
        task_status.started(RunningRouter(port=port, app=app))


async def serve_discovery(
    settings: Settings, fleet: Fleet, http: httpx.AsyncClient, metrics: RouterMetrics,
    *, task_status: trio.TaskStatus[DiscoveryHealth] = trio.TASK_STATUS_IGNORED,
) -> None:
    if settings.discovery == "etcd":
        from router.discovery.etcd import serve_etcd_discovery

        await serve_etcd_discovery(settings, fleet, metrics, task_status=task_status)
    else:
        await serve_static_discovery(fleet, settings.workers, http, task_status=task_status)


async def _main(settings: Settings) -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    if shutdown.is_set():
                        log.warning("second %s: stopping now", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return
                    log.info(
                        "%s: no new connections; in-flight requests get up to %gs",
                        signal.Signals(signum).name, settings.shutdown_grace_s,
                    )
                    shutdown.set()

        nursery.start_soon(watch_signals)
        await run_router(settings, shutdown=shutdown)
        nursery.cancel_scope.cancel()
    log.info("router stopped")


def build_parser() -> argparse.ArgumentParser:
    """Every `router serve` flag: the settings of `router.config`, plus `--reuse-port`."""
    parser = argparse.ArgumentParser(prog="router serve", description="Run the router in front of a fleet.")
    add_arguments(parser)
    parser.add_argument(
        "--reuse-port", action="store_true",
        help="listen with SO_REUSEPORT, sharing the port with other router processes "
        "(what each process of --processes does)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        settings = load_settings(args)
    except ConfigError as error:
        print(f"router serve: {error}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    # httpx logs every health check and etcd call at INFO: decisions, not traffic, belong here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.reuse_port:
        settings = dataclasses.replace(settings, reuse_port=True)
    if settings.server == "hypercorn" and importlib.util.find_spec("hypercorn") is None:
        print("router serve: --server hypercorn needs hypercorn: pip install 'trio-router[asgi]'", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    if settings.processes > 1:
        from router.processes import run_processes

        return run_processes(settings, argv)
    exit_code = 0
    try:
        trio.run(_main, settings)
    except* CannotListen as group:
        print(f"router serve: {_first_leaf(group)}", file=sys.stderr)
        exit_code = EXIT_BIND_FAILED
    return exit_code


def _first_leaf(error: BaseException) -> BaseException:
    """The first exception that is not a group (nurseries nest the one that matters)."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error

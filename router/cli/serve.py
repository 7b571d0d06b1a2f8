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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import httpx
import trio
from prometheus_client import CollectorRegistry, Gauge, GCCollector

from router.api.errors import answer_refusal
from router.cli.config import (
    ConfigError,
    Settings,
    add_arguments,
    load_settings,
    model_names,
    traffic_settings,
)
from router.cli.fleet_pruning import DepartedWorkerPruner
from router.discovery import DiscoveryHealth
from router.discovery.kube_config import KubeConfigError
from router.discovery.kube_pods import pod_sources
from router.discovery.kubernetes import KubeDiscoverySettings, serve_kubernetes_discovery
from router.discovery.static import serve_static_discovery
from router.edge.admin import AdminApi
from router.edge.admission import AdmissionCollector, AdmissionGate, AdmissionSettings
from router.edge.app import RouterApp
from router.edge.auth import ClientKeys, KeysFileError, serve_key_reloads
from router.engines.adapter_lists import AdapterLists, AdapterListSettings, serve_adapter_lists
from router.engines.adapter_metrics import AdapterCollector
from router.engines.facts import FactsSettings, serve_engine_facts
from router.engines.grpc_service import healthy as grpc_healthy
from router.engines.kv_events.fleet_views import (
    KvEvents,
    KvEventsSettings,
    KvIndexes,
    serve_kv_events,
)
from router.engines.load_metrics import EngineLoadCollector
from router.engines.load_reader import EngineLoads, LoadReaderSettings, serve_engine_loads
from router.fleet.breaker import BreakerSettings, BreakerState, make_breaker
from router.fleet.candidates import AllOpenMode
from router.fleet.health import serve_health_checks
from router.fleet.registry import BreakerFactory, Fleet
from router.http.grpc import GrpcPool, GrpcPoolSettings, open_grpc_pool
from router.http.server.load import ServerLoad
from router.http.server.loop import serve_http
from router.http.server.settings import ServerSettings
from router.http.upstream.pool import PoolSettings, open_upstream_pool
from router.observability.garbage_collection import PAUSES, GarbageCollectionCollector, settle
from router.observability.logs import configure_logging
from router.observability.metrics import BreakerMetrics, DiscoveryMetrics, RouterMetrics
from router.observability.request_id import current_request_id
from router.observability.runtime_metrics import TaskCollector
from router.observability.tracing import open_tracing, otel_installed
from router.pipeline.dispatch import Timeouts
from router.pipeline.engine_tokens import EngineTokenSettings
from router.pipeline.resume import ResumeSettings, parse_routes
from router.pipeline.service import FailoverSettings, GenerationService
from router.pipeline.token_metrics import TokenSourcesCollector
from router.pipeline.wait import WorkerWaitCollector, WorkerWaitSettings
from router.policies.adapter_affinity import AdapterAffinitySettings
from router.policies.cache_aware import CacheAware, CacheAwareCollector, CacheAwareSettings
from router.policies.kv_aware import KvAware, KvAwareSettings, KvPolicyInputs
from router.policies.kv_aware_metrics import KvAwareCollector
from router.policies.spread import SpreadSettings
from router.prompts.token_sources import (
    TokenSource,
    TokenSources,
    TokenSourceSettings,
    parse_order,
    serve_token_sources,
)
from router.prompts.tokenizer import HfTokenizer

log = logging.getLogger("router")
EXIT_BAD_SETTINGS = 2
EXIT_BIND_FAILED = 3


class CannotListen(Exception):
    """The HTTP server could not bind its address (in use, not local, not resolvable)."""


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(slots=True)
class RunningRouter:
    host: str
    port: int
    app: RouterApp
    metrics: RouterMetrics

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def fleet(self) -> Fleet:
        return self.app.fleet


def _breaker_factory(settings: Settings, breakers: BreakerMetrics) -> BreakerFactory:
    breaker_settings = BreakerSettings(
        failure_threshold=settings.breaker_failure_threshold,
        cooldown_s=settings.breaker_cooldown_s,
        max_cooldown_s=settings.breaker_max_cooldown_s,
    )

    def on_transition(name: str, old: BreakerState, new: BreakerState, now: float) -> None:
        if new is BreakerState.OPEN:
            # A trip is an outage beginning (closed -> open), as `/v1/workers` counts it; a
            # failed probe extends the outage and shows in the state gauge and the log.
            # A worker that already left (its last request failing) gets no new series.
            if old is BreakerState.CLOSED:
                breakers.count_trip(name)
            # Runs inside the request whose verdict tripped it: the log names that request.
            log.warning(
                "breaker of %s opened (was %s) [request %s]",
                name,
                old.name.lower(),
                current_request_id(),
            )
        elif new is BreakerState.HALF_OPEN:
            # The probe itself is logged when it is dispatched (router/pipeline/attempt.py).
            log.debug("breaker of %s is half-open: the next request to it is the probe", name)
        else:
            log.info("breaker of %s closed: the worker recovered", name)

    return lambda worker_id: make_breaker(breaker_settings, worker_id, on_transition)


def client_keys(settings: Settings) -> ClientKeys:
    """The client keys of `settings`; ConfigError when the keys file cannot be used."""
    try:
        return ClientKeys(settings.api_key, settings.api_keys_file, traffic_settings(settings))
    except KeysFileError as error:
        raise ConfigError(str(error)) from None


def kv_tokenizer(settings: Settings) -> HfTokenizer | None:
    """The `--kv-tokenizer` file or model directory, loaded (with the model's chat template
    when the directory has one); ConfigError when it cannot be used."""
    if not settings.kv_tokenizer:
        return None
    try:
        return HfTokenizer(settings.kv_tokenizer)
    except ValueError as error:
        raise ConfigError(f"--kv-tokenizer: {error}") from None


LOAD_POLICIES = frozenset({"least_load", "power_of_two", "cache_aware", "kv_aware"})
"""The policies that read load (`Worker.load`)."""


def engine_load_settings(settings: Settings) -> LoadReaderSettings | None:
    """How the engines' own load is read; None when no chosen policy reads load, or
    `--engine-load-interval-s` is 0."""
    policies = {settings.policy, settings.prefill_policy, settings.decode_policy}
    if settings.engine_load_interval_s <= 0 or not policies & LOAD_POLICIES:
        return None
    return LoadReaderSettings(
        interval_s=settings.engine_load_interval_s,
        timeout_s=settings.engine_load_timeout_s,
        window_s=settings.engine_load_window_s,
        worker_api_key=settings.worker_api_key,
        server_load_interval_s=settings.engine_server_load_interval_s,
        server_load_window_s=settings.engine_server_load_window_s,
    )


def failover_settings(settings: Settings) -> FailoverSettings:
    """What the generation path reads of `settings`."""
    all_open = AllOpenMode(settings.breaker_all_open)
    return FailoverSettings(
        policy=settings.policy,
        prefill_policy=settings.prefill_policy,
        decode_policy=settings.decode_policy,
        cache=CacheAwareSettings(
            cache_threshold=settings.cache_threshold,
            balance_abs_threshold=settings.balance_abs_threshold,
            balance_rel_threshold=settings.balance_rel_threshold,
            max_tree_size=settings.max_tree_size,
        ),
        all_open=all_open,
        timeouts=Timeouts(
            settings.connect_timeout_s,
            settings.first_byte_timeout_s,
            settings.stream_idle_timeout_s,
        ),
        wait=WorkerWaitSettings(
            capacity_wait_s=settings.queue_timeout_s,
            workers_wait_s=settings.wait_for_workers_s,
            all_open=all_open,
            retry_after_s=settings.retry_after_s,
        ),
        max_attempts=settings.max_attempts,
        max_n=settings.max_n,
        retry_after_s=settings.retry_after_s,
        model_memory_s=settings.model_memory_s,
        worker_api_key=settings.worker_api_key,
        spread=SpreadSettings(
            margin=settings.spread_margin,
            seed=None if settings.policy_seed < 0 else settings.policy_seed,
        ),
        resume=ResumeSettings(
            limit=settings.resume_limit,
            routes=parse_routes(settings.resume_routes),
            max_ids=settings.resume_max_ids,
        ),
        engine_priority=settings.engine_priority_scheduling,
        names=model_names(settings),
        answer_alias=settings.alias_answer_model == "alias",
        adapters=adapter_affinity(settings),
    )


def adapter_affinity(settings: Settings) -> AdapterAffinitySettings:
    """What a LoRA adapter's slots cost the load-reading policies; ConfigError when the
    wait costs less than a free slot."""
    try:
        return AdapterAffinitySettings(
            slot_cost=settings.adapter_slot_cost, wait_cost=settings.adapter_wait_cost
        )
    except ValueError as error:
        raise ConfigError(f"--adapter-slot-cost / --adapter-wait-cost: {error}") from None


def admission_settings(settings: Settings) -> AdmissionSettings:
    return AdmissionSettings(
        limit=settings.max_concurrent_requests,
        queue_size=settings.queue_size,
        timeout_s=settings.queue_timeout_s,
        retry_after_s=settings.retry_after_s,
        classes=traffic_settings(settings).classes,
    )


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
        body_timeout_s=settings.body_timeout_s,
        client_write_timeout_s=settings.client_write_timeout_s,
        max_buffered_body_bytes=settings.max_buffered_body_bytes,
    )


def register_server_gauges(load: ServerLoad, registry: CollectorRegistry) -> None:
    """Expose the native server's `load` as gauges read at scrape time (the hypercorn front
    has no such counts, so it gets no such gauges)."""
    Gauge(
        "router_client_connections", "Client connections being served", registry=registry
    ).set_function(lambda: load.connections)
    Gauge(
        "router_client_turn_away_tasks",
        "Connections past --max-connections being answered 503",
        registry=registry,
    ).set_function(lambda: load.turning_away)
    Gauge(
        "router_buffered_body_bytes",
        "Request-body bytes the server holds (budget --max-buffered-body-bytes)",
        registry=registry,
    ).set_function(lambda: load.body_bytes)


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
    keys = client_keys(settings)
    metrics = RouterMetrics(
        registry=registry, key_label=keys.named, tenant_label=settings.admission_metrics_by_tenant
    )
    reads_engine_load = engine_load_settings(settings) is not None
    fleet = Fleet(
        _breaker_factory(settings, metrics.breakers),
        model_memory_s=settings.model_memory_s,
        clock=trio.current_time,
        max_inflight=settings.worker_max_inflight,
        engine_shares=reads_engine_load,
    )
    metrics.watch_fleet(fleet)
    admission = AdmissionGate(admission_settings(settings), metrics.admission)
    metrics.registry.register(
        AdmissionCollector(admission, by_tenant=settings.admission_metrics_by_tenant)
    )
    pool_settings = PoolSettings(
        max_idle_per_worker=settings.pool_max_idle_per_worker,
        idle_expiry_s=settings.pool_idle_expiry_s,
        max_connections_per_worker=settings.max_connections_per_worker,
    )
    async with (
        open_upstream_pool(pool_settings) as pool,
        open_grpc_pool(
            GrpcPoolSettings(max_calls_per_worker=settings.max_connections_per_worker)
        ) as grpc,
        httpx.AsyncClient(timeout=settings.health_timeout_s) as http,
        open_tracing(settings.otlp_traces_endpoint) as tracing,
        trio.open_nursery() as nursery,
    ):
        metrics.watch_pool(pool)
        metrics.watch_grpc_pool(grpc)
        metrics.registry.register(TaskCollector())
        PAUSES.install()  # once per process: the collector's clock is the interpreter's
        metrics.registry.register(GarbageCollectionCollector())
        GCCollector(registry=metrics.registry)
        # Before discovery, so a worker named without its facts is asked at once.
        await nursery.start(
            partial(
                serve_engine_facts,
                fleet,
                http,
                FactsSettings(
                    timeout_s=settings.health_timeout_s, worker_api_key=settings.worker_api_key
                ),
                grpc=grpc,
            )
        )
        discovery: DiscoveryHealth = await nursery.start(
            partial(serve_discovery, settings, fleet, http, metrics.discovery, grpc=grpc)
        )
        await nursery.start(
            partial(
                serve_health_checks,
                fleet,
                http,
                interval_s=settings.health_interval_s,
                timeout_s=settings.health_timeout_s,
                failure_threshold=settings.health_failure_threshold,
                success_threshold=settings.health_success_threshold,
                grpc=partial(grpc_healthy, grpc),
            )
        )
        if settings.api_keys_file:
            await nursery.start(serve_key_reloads, keys)
        admin = None
        if settings.admin_api_key:
            admin = AdminApi(
                fleet,
                http,
                nursery,
                admin_key=settings.admin_api_key,
                worker_api_key=settings.worker_api_key,
                discovery_owns_fleet=settings.discovery != "static",
                drain_timeout_s=settings.shutdown_grace_s,
            )
        load_settings = engine_load_settings(settings)
        engine_loads: EngineLoads | None = None
        if load_settings is not None:
            # The engines' own load, which every process and replica reads alike.
            engine_loads = EngineLoads(fleet, load_settings, grpc)
            await nursery.start(serve_engine_loads, engine_loads, pool)
        metrics.registry.register(EngineLoadCollector(engine_loads))
        # With the interval 0 no reader runs: only routing misses change what is held.
        adapter_lists = AdapterLists(
            fleet,
            AdapterListSettings(
                interval_s=settings.adapter_list_interval_s or 1.0,
                timeout_s=settings.health_timeout_s,
                worker_api_key=settings.worker_api_key,
            ),
        )
        if settings.adapter_list_interval_s > 0:
            # The adapters each engine holds: its model list, read while it is in the fleet.
            await nursery.start(serve_adapter_lists, adapter_lists)
        metrics.registry.register(AdapterCollector(adapter_lists))
        kv_indexes = KvIndexes()
        kv_events: KvEvents | None = None
        failover = failover_settings(settings)
        if "kv_aware" in (settings.policy, settings.prefill_policy, settings.decode_policy):
            # The engines' own cache views: subscriptions follow the fleet.
            kv_events = KvEvents(
                fleet,
                kv_indexes,
                KvEventsSettings(
                    port=settings.kv_events_port, replay_port=settings.kv_events_replay_port
                ),
                grpc_pool=grpc,
            )
            await nursery.start(serve_kv_events, kv_events)
            operator = kv_tokenizer(settings)
            order = parse_order(settings.kv_token_sources)
            token_sources = TokenSources(
                fleet,
                TokenSourceSettings(
                    order=order,
                    operator_path=settings.kv_tokenizer,
                    worker_api_key=settings.worker_api_key,
                ),
                operator,
            )
            await nursery.start(serve_token_sources, token_sources, http)
            failover = dataclasses.replace(
                failover,
                kv=KvPolicyInputs(
                    KvAwareSettings(overlap_weight=settings.kv_overlap_weight),
                    kv_indexes,
                    trio.current_time,
                    operator,
                    token_sources.local,
                ),
                token_sources=token_sources,
                engine_tokens=EngineTokenSettings(
                    timeout_s=settings.kv_tokenize_timeout_s,
                    max_concurrent=settings.kv_tokenize_max_concurrent,
                )
                if TokenSource.ENGINE in order
                else None,
            )
        if failover.resume.limit > 0 and failover.token_sources is None:
            # The text after a resumed stream's seam is made with the model's tokenizer:
            # the operator's, or the model directory the engine reports, read here.
            token_sources = TokenSources(
                fleet,
                TokenSourceSettings(
                    order=tuple(
                        source
                        for source in parse_order(settings.kv_token_sources)
                        if source is not TokenSource.ENGINE
                    )
                    or (TokenSource.TOKENIZER,),
                    operator_path=settings.kv_tokenizer,
                    worker_api_key=settings.worker_api_key,
                    for_resume_only=True,
                ),
                kv_tokenizer(settings),
            )
            await nursery.start(serve_token_sources, token_sources, http)
            failover = dataclasses.replace(failover, token_sources=token_sources)
        generation = GenerationService(
            failover,
            fleet,
            pool,
            metrics.requests,
            metrics.pipeline,
            on_adapter_miss=adapter_lists.missed,
            grpc=grpc,
        )
        # Registered under every policy, so the families exist (empty) whatever is chosen.
        metrics.registry.register(
            CacheAwareCollector(
                {
                    role: policy
                    for role, policy in generation.policies.items()
                    if isinstance(policy, CacheAware)
                }
            )
        )
        metrics.registry.register(
            KvAwareCollector(
                {
                    role: policy
                    for role, policy in generation.policies.items()
                    if isinstance(policy, KvAware)
                },
                kv_events.statistics if kv_events is not None else None,
                kv_indexes,
            )
        )
        metrics.registry.register(
            TokenSourcesCollector(failover.token_sources, generation.engine_tokens)
        )
        await nursery.start(generation.runner.stalls.serve)
        app = RouterApp(
            generation,
            metrics.requests,
            metrics.render,
            discovery,
            protect_metrics=settings.protect_metrics,
            keys=keys,
            admission=admission,
            admin=admin,
            tracing=tracing,
        )
        metrics.registry.register(WorkerWaitCollector(generation.waits))
        # Attached once the app exists: a worker that left before it (during the first
        # listing) had no request, so no pool endpoint, rank state or series to prune.
        fleet.add_listener(
            DepartedWorkerPruner(
                pool, generation.ranks, metrics.breakers, grpc, generation.grpc_engines
            )
        )

        serve: Callable[..., Awaitable[None]]
        if settings.server == "hypercorn":
            from router.http.server.asgi import serve_asgi

            serve = partial(serve_asgi, answer_refusal=answer_refusal)
        else:
            load = ServerLoad(settings.max_buffered_body_bytes)
            register_server_gauges(load, metrics.registry)
            serve = partial(serve_http, load=load, answer_refusal=answer_refusal)

        async def serve_until_drained(*, task_status: trio.TaskStatus[int]) -> None:
            await serve(
                app.handle, server_settings(settings), shutdown=shutdown, task_status=task_status
            )
            nursery.cancel_scope.cancel()

        try:
            port = await nursery.start(serve_until_drained)
        except OSError as exc:
            raise CannotListen(f"cannot listen on {settings.host}:{settings.port}: {exc}") from exc
        # Operators and scripts read the bound URL from this line (with --port 0 it is
        # the only place the port shows up).
        log.info(
            "router listening on %s with %d workers", http_url(settings.host, port), len(fleet)
        )
        task_status.started(RunningRouter(host=settings.host, port=port, app=app, metrics=metrics))


async def serve_discovery(
    settings: Settings,
    fleet: Fleet,
    http: httpx.AsyncClient,
    metrics: DiscoveryMetrics,
    *,
    grpc: GrpcPool | None = None,
    task_status: trio.TaskStatus[DiscoveryHealth] = trio.TASK_STATUS_IGNORED,
) -> None:
    if settings.discovery == "etcd":
        from router.discovery.etcd import EtcdDiscoveryTiming, serve_etcd_discovery

        await serve_etcd_discovery(
            settings.etcd_endpoint,
            settings.etcd_prefix,
            fleet,
            metrics,
            timing=EtcdDiscoveryTiming(silence_s=settings.discovery_silence_s),
            task_status=task_status,
        )
    elif settings.discovery == "kubernetes":
        await serve_kubernetes_discovery(
            kube_settings(settings), fleet, metrics, task_status=task_status
        )
    else:
        await serve_static_discovery(
            fleet,
            settings.workers,
            http,
            worker_api_key=settings.worker_api_key,
            grpc=grpc,
            task_status=task_status,
        )


def kube_settings(settings: Settings) -> KubeDiscoverySettings:
    return KubeDiscoverySettings(
        sources=pod_sources(
            settings.k8s_selector, settings.k8s_prefill_selector, settings.k8s_decode_selector
        ),
        namespace=settings.k8s_namespace or None,
        port=settings.k8s_port,
        kubeconfig=settings.k8s_kubeconfig or None,
    )


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
                        signal.Signals(signum).name,
                        settings.shutdown_grace_s,
                    )
                    shutdown.set()

        nursery.start_soon(watch_signals)

        async def route_then_stop(*, task_status: trio.TaskStatus[RunningRouter]) -> None:
            await run_router(settings, shutdown=shutdown, task_status=task_status)
            nursery.cancel_scope.cancel()

        await nursery.start(route_then_stop)
        # Serving: what start-up built stays for the process's life (see the module).
        settle(settings.gc_young_threshold)
    log.info("router stopped")


def build_parser() -> argparse.ArgumentParser:
    """Every `router serve` flag: the settings of `router.cli.config`, plus `--reuse-port`."""
    parser = argparse.ArgumentParser(
        prog="router serve", description="Run the router in front of a fleet."
    )
    add_arguments(parser)
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="listen with SO_REUSEPORT, sharing the port with other router processes "
        "(what each process of --processes does)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        settings = load_settings(args)
        client_keys(settings)  # a bad keys file stops the start, like any bad setting
        adapter_affinity(settings)
        kv_tokenizer(settings)  # and so does a tokenizer file that cannot be loaded
    except ConfigError as error:
        print(f"router serve: {error}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    configure_logging(settings.log_level)
    if args.reuse_port:
        settings = dataclasses.replace(settings, reuse_port=True)
    if settings.server == "hypercorn" and importlib.util.find_spec("hypercorn") is None:
        print(
            "router serve: --server hypercorn needs hypercorn: pip install 'trio-router[asgi]'",
            file=sys.stderr,
        )
        return EXIT_BAD_SETTINGS
    if settings.otlp_traces_endpoint and not otel_installed():
        print(
            "router serve: --otlp-traces-endpoint needs OpenTelemetry: pip install 'trio-router[otel]'",
            file=sys.stderr,
        )
        return EXIT_BAD_SETTINGS
    if settings.processes > 1:
        from router.cli.processes import run_processes

        return run_processes(settings, argv)
    exit_code = 0
    try:
        trio.run(_main, settings)
    except* CannotListen as group:
        print(f"router serve: {_first_leaf(group)}", file=sys.stderr)
        exit_code = EXIT_BIND_FAILED
    except* KubeConfigError as group:
        print(f"router serve: {_first_leaf(group)}", file=sys.stderr)
        exit_code = EXIT_BAD_SETTINGS
    return exit_code


def _first_leaf(error: BaseException) -> BaseException:
    """The first exception that is not a group (nurseries nest the one that matters)."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error

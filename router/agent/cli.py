"""`router agent`: register an engine in etcd, keep it registered, drain it on SIGTERM.

Runs beside the engine (same machine or Pod). It waits for the engine's `/health`, learns
the engine's kind from its answers unless `--engine` names it (the rule is
`router.engines.facts.engine_kind`; the kind picks the `/metrics` names a drain
reads), then registers; on SIGTERM or SIGINT it announces DRAINING, waits until the engine's own
`/metrics` show no work, deregisters and exits 0. A second signal cuts the wait short
(the worker still deregisters). It never stops the engine: that is the caller's job.

Exit status: 0 after a signal, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from urllib.parse import urlsplit

import httpx
import trio

from router.agent.advertise import (
    advertised_url,
    etcd_endpoint_url,
    loopback_warning,
    worker_record,
)
from router.agent.drain import DrainSettings, read_engine_load
from router.agent.flags import add_registration_flags, registration_flags
from router.agent.registration import run_registered
from router.engines.facts import FactsUnavailable, detect_engine
from router.engines.metrics import ENGINES, UNREADABLE, EngineLoad
from router.fleet.records import Role, WorkerRecord
from router.observability.logs import configure_logging

log = logging.getLogger("router.agent")
ENGINE_TIMEOUT_S = 5.0
KIND_ATTEMPTS = 10
"""Questions about the engine's kind before the agent registers it as unknown: a healthy
engine that cannot say in that many tries is not going to."""


@dataclass(frozen=True, slots=True)
class AgentOptions:
    engine_url: str
    engine: str | None
    """None: learned from the engine before registering (`--engine` not given)."""
    etcd_endpoint: str
    etcd_prefix: str
    advertise_host: str
    record: WorkerRecord
    lease_ttl_s: int
    drain: DrainSettings
    health_poll_s: float


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router agent",
        description="Register an engine in etcd for the router, and drain it on SIGTERM.",
    )
    engine = parser.add_argument_group("the engine")
    engine.add_argument(
        "--engine-url",
        required=True,
        help="where this agent reaches the engine, e.g. http://127.0.0.1:30000",
    )
    engine.add_argument("--model", required=True, help="the model id the engine serves")
    engine.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter the engine holds (repeatable); routers also learn them from the engine's model list",
    )
    engine.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default=None,
        help="engine kind: its /metrics names (default: learned from what the engine serves)",
    )
    engine.add_argument(
        "--role", choices=[r.value for r in Role], default="mixed", help="PD role (default mixed)"
    )
    engine.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help="prefill only: the KV bootstrap port decodes pull from",
    )
    engine.add_argument(
        "--pd-protocol",
        default="mooncake",
        help="prefill only: KV transfer backend (default mooncake)",
    )
    engine.add_argument(
        "--dp-size", type=int, default=1, help="data-parallel ranks behind this URL (default 1)"
    )
    engine.add_argument(
        "--dp-rank", type=int, default=None, help="the one rank this URL serves, if it serves one"
    )
    engine.add_argument(
        "--health-poll-s",
        type=float,
        default=1.0,
        help="how often to ask the engine's /health before registering (default 1)",
    )
    etcd = parser.add_argument_group("registration and drain on SIGTERM")
    etcd.add_argument(
        "--etcd-endpoint",
        default="http://127.0.0.1:2379",
        help="etcd client URL (default %(default)s)",
    )
    add_registration_flags(etcd, advertise_default="the --engine-url host")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info"
    )
    return parser


def options_from_args(args: argparse.Namespace) -> AgentOptions:
    """Validated options; a ValueError names the flag that is wrong."""
    flags = registration_flags(args)
    engine_url = args.engine_url.rstrip("/")
    engine_host = urlsplit(engine_url).hostname
    if urlsplit(engine_url).scheme not in ("http", "https") or not engine_host:
        raise ValueError(f"--engine-url must be http(s)://HOST:PORT, got {args.engine_url!r}")
    advertise_host = flags.advertise_host or engine_host
    url = advertised_url(engine_url, advertise_host)
    if args.role == "prefill" and args.bootstrap_port is None:
        raise ValueError("--role prefill needs --bootstrap-port (decodes pull KV from it)")
    if not args.health_poll_s > 0:
        raise ValueError(f"--health-poll-s must be > 0, got {args.health_poll_s}")
    record = worker_record(
        worker_id=flags.worker_id or url.split("://", 1)[1],
        url=url,
        model=args.model,
        role=args.role,
        engine=args.engine,
        dp_size=args.dp_size,
        dp_rank=args.dp_rank,
        bootstrap_port=args.bootstrap_port,
        pd_protocol=args.pd_protocol,
        adapters=tuple(args.adapter),
    )
    return AgentOptions(
        engine_url=engine_url,
        engine=args.engine,
        etcd_endpoint=etcd_endpoint_url(args.etcd_endpoint),
        etcd_prefix=flags.etcd_prefix,
        advertise_host=advertise_host,
        record=record,
        lease_ttl_s=flags.lease_ttl_s,
        drain=flags.drain,
        health_poll_s=args.health_poll_s,
    )


async def wait_engine_healthy(http: httpx.AsyncClient, health_url: str, poll_s: float) -> None:
    """Return once `health_url` answers 200, asking every `poll_s` (an engine loading its
    weights answers 503 or refuses connections for minutes). Logs the first wait only."""
    waiting_since: float | None = None
    while True:
        try:
            response = await http.get(health_url, timeout=ENGINE_TIMEOUT_S)
            if response.status_code == 200:
                if waiting_since is not None:
                    log.info("engine is healthy after %.1fs", trio.current_time() - waiting_since)
                return
            reason = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            reason = type(exc).__name__
        if waiting_since is None:
            waiting_since = trio.current_time()
            log.info("waiting for the engine at %s to be healthy (%s)", health_url, reason)
        await trio.sleep(poll_s)


@dataclass(slots=True)
class EngineView:
    """The engine as the agent knows it: where its metrics are and its kind (None while
    unknown: its load cannot be read then, and a drain stops waiting, loudly)."""

    http: httpx.AsyncClient
    metrics_url: str
    engine: str | None

    async def read_load(self) -> EngineLoad:
        if self.engine is None:
            return UNREADABLE
        return await read_engine_load(self.http, self.metrics_url, self.engine)


async def learn_engine_kind(http: httpx.AsyncClient, engine_url: str, poll_s: float) -> str | None:
    """The engine's kind from its answers (`detect_engine`), asking again every `poll_s`
    while it is not ready to say, at most KIND_ATTEMPTS times; None when it fits no kind."""
    for attempt in range(1, KIND_ATTEMPTS + 1):
        try:
            return await detect_engine(http, engine_url, ENGINE_TIMEOUT_S)
        except FactsUnavailable as exc:
            if attempt == KIND_ATTEMPTS:
                log.warning("the engine's kind cannot be learned: %s", exc)
                return None
            log.info("the engine's kind is not known yet (%s); asking again", exc)
            await trio.sleep(poll_s)
    return None


async def prepare_engine(
    http: httpx.AsyncClient, options: AgentOptions, view: EngineView
) -> WorkerRecord:
    """Wait for the engine's health, learn its kind unless `--engine` named it, then read
    its load once, so an engine whose work cannot be read is reported at start rather than
    discovered at the first SIGTERM. The record to register, with the kind."""
    await wait_engine_healthy(http, options.engine_url + "/health", options.health_poll_s)
    if view.engine is None:
        view.engine = await learn_engine_kind(http, options.engine_url, options.health_poll_s)
        if view.engine is None:
            log.warning(
                "the engine at %s answers as neither SGLang nor vLLM: its /metrics names are "
                "unknown, so a drain will not be able to wait for its in-flight requests "
                "(pass --engine)",
                options.engine_url,
            )
            return options.record
        log.info("the engine at %s runs %s (as it answers)", options.engine_url, view.engine)
    load = await view.read_load()
    if load.total is None:
        log.warning(
            "the engine's /metrics do not show its %s load: a drain will not be able to wait "
            "for its in-flight requests (SGLang exports them only with --enable-metrics)",
            view.engine,
        )
    return replace(options.record, engine=view.engine)


async def run_agent(options: AgentOptions) -> int:
    """Run until a signal ends the drain; the exit status."""
    engine_url = options.engine_url
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with httpx.AsyncClient(timeout=ENGINE_TIMEOUT_S) as http:
            view = EngineView(http, engine_url + "/metrics", options.engine)
            await run_registered(
                options.etcd_endpoint,
                options.etcd_prefix,
                options.record,
                lease_ttl_s=options.lease_ttl_s,
                read_load=view.read_load,
                drain_settings=options.drain,
                signals=signals,
                before_registering=partial(prepare_engine, http, options, view),
            )
    log.info("agent stopped")
    return 0


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(args.log_level)
    warning = loopback_warning(options.advertise_host, options.etcd_endpoint)
    if warning:
        log.warning("%s", warning)
    log.info(
        "agent for %s (%s, %s) registering at %s%s",
        options.record.url,
        options.record.role.value,
        options.engine or "engine kind to learn",
        options.etcd_endpoint,
        options.etcd_prefix,
    )
    return trio.run(run_agent, options)

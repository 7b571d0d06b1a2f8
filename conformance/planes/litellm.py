"""LiteLLM's proxy (`litellm[proxy]` on PyPI, Python), launched as its `litellm` script
from a venv of its own (`make litellm-env`: its pins conflict with the main venv's).

Mapping notes, each read from the installed package and checked on the proxy:
- the fleet is a generated config file: one `model_list` deployment per worker, of the
  OpenAI-compatible provider (`openai/<model>`, `api_base` = the worker's URL + `/v1`),
  grouped by model name, so the proxy balances and fails over inside a group;
- `settings.policy` is its `router_settings.routing_strategy`: `random` is
  `simple-shuffle` (its default: weighted random, every weight equal here) and
  `least_load` is `least-busy`; it has no round robin, consistent hashing, power of two
  or cache-aware strategy;
- `attempts` is `num_retries` (retries after the first try), the breaker is its
  cooldown: `allowed_fails` failures in a minute are allowed and the next one cools the
  deployment down for `cooldown_time` seconds, so a threshold of N is `allowed_fails`
  N - 1; threshold 0 is `disable_cooldowns`. There is no half-open state, no backoff and
  nothing that dispatches when every deployment cools down;
- the client key is `general_settings.master_key`; a case without one sets
  `dangerously_permit_weak_or_unset_master_key`, without which it refuses to start;
- it binds the `--port` it is given, so the runner picks one; it reads no model cost map
  from the network (`LITELLM_LOCAL_MODEL_COST_MAP`), since the machines are offline;
- it starts slowly (about 27 s and 14 CPU-s on an idle 2-core machine), hence the long
  readiness bound, and its first request on each route pays for imports it defers (2 s
  idle; over 10 s, a case's request timeout, with four cases starting at once). So each
  case gets a warm-up worker of the plane's own (a sidecar fake worker serving the model
  `conformance-warmup`, outside the fleet, whose counts no case reads), and readiness
  includes one request per route to it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx
import trio
import yaml

from conformance.client import default_body
from conformance.fleet import FAKE_WORKER_COMMAND, LISTENING
from conformance.model import ROUTES, Case
from conformance.planes.base import Launch, Plane, Unsupported
from conformance.sidecars import Sidecars

REPO = Path(__file__).resolve().parents[2]
# Where `make litellm-env` installs it; another venv can be named in the environment.
VENV = Path(os.environ.get("CONFORMANCE_LITELLM_VENV", REPO / ".venv-litellm"))
STRATEGIES = {"random": "simple-shuffle", "least_load": "least-busy"}
# The workers ignore the key; the OpenAI provider will not start without one.
WORKER_KEY = "conformance-worker-key"
WARMUP_MODEL = "conformance-warmup"
WARMUP_KEY = "litellm_warmup_url"
# One request per route it serves, the first of them streamed.
WARMUP_ROUTES = (
    ("chat", True),
    ("chat", False),
    ("completions", False),
    ("responses", False),
    ("messages", False),
    ("embeddings", False),
)


class LiteLLMPlane(Plane):
    name = "litellm"
    divergences: ClassVar[Path | None] = Path(__file__).with_name("litellm_divergences.yaml")
    distribution = "litellm"
    install_hint: ClassVar[str] = "make litellm-env (a venv of its own, .venv-litellm)"
    interpreter: ClassVar[str] = str(VENV / "bin" / "python")
    capabilities = frozenset(
        {
            "policy.random",
            "policy.least_load",
            "auth.client_key",
            # Its OpenAI and Anthropic routes; it has no SGLang-native /generate.
            "route.completions",
            "route.responses",
            "route.messages",
            "route.embeddings",
        }
    )
    # Observed with `conformance run --plane litellm --run-unsupported -v` where it says
    # "observed"; the rest read from the installed package (1.106.12).
    missing_notes: ClassVar[Mapping[str, str]] = {
        "upstream.grpc": "its deployments are HTTP API endpoints; no gRPC engine client (read, "
        "not observed)",
        "policy.round_robin": "routing_strategy is simple-shuffle, least-busy, usage-based-routing(-v2), "
        "latency-based-routing or cost-based-routing: no round robin",
        "policy.power_of_two": "no power-of-two strategy",
        "policy.consistent_hash": "no consistent-hash strategy (only tag-based and model-group routing)",
        "policy.cache_aware": "no cache-aware strategy",
        "breaker.single_probe": "no half-open state: a cooled-down deployment is simply "
        "eligible again after cooldown_time",
        "breaker.backoff": "cooldown_time is fixed; it never grows after a failure",
        "breaker.all_open_dispatch": "no setting dispatches to cooled-down deployments; its "
        "router refuses a group with none left (read, not observed)",
        "breaker.all_open_reject": "no setting for it; observed (random for round robin, "
        "allowed_fails 1, cooldown_time 30): after 3 failures on a and 1 on b, the next 3 "
        "requests were still dispatched (a 2, b 1) and answered 200, never 503",
        "health.active": "no health settings to map; observed: with both workers' /health "
        "failing, requests were dispatched and answered 200 for the 8 s the case polls and "
        "after (its background health checks report deployments, they do not route)",
        "admission.queue": "limits are per key, user or team (max_parallel_requests, rpm); no global "
        "limit with a bounded queue",
        "worker.status": "deployments come from a static config: there is no DRAINING state",
        "discovery.etcd": "no etcd discovery: deployments come from its config file or its database",
        "discovery.kubernetes": "no Kubernetes discovery: deployments come from its config file or its database",
        "pd": "no prefill/decode disaggregation: every deployment is a whole model server",
        "pd.mixed_fleet": "no prefill/decode disaggregation",
        "pd.bootstrap": "no prefill/decode disaggregation",
        "pd.nixl": "no prefill/decode disaggregation",
        "dp_rank": "no data-parallel ranks: a deployment is one URL",
        "cache_aware.smallest_tree": "no cache-aware strategy",
        "route.generate": "no POST /generate: it serves the OpenAI and Anthropic APIs only",
        "limits.body_size": "its only body limit, general_settings.max_request_size_mb, takes "
        "whole megabytes and is an enterprise-only feature",
        # Observed on the lora/ cases (1.106.12): engines listing adapters with parent m.
        "lora.adapters": "it serves the model names of its config only: /v1/models listed m, "
        'and every request for adapter x or y, or an unknown one, was its own 400 ("Invalid '
        'model name passed in model=x"), 0 dispatches (lora/adapter-goes-only-to-engines-holding-it, '
        "lora/unknown-adapter-404)",
        "lora.routing_miss": "no request for an adapter reaches an engine (lora.adapters): 8 of 8 "
        "were its own 400 (lora/unloaded-adapter-is-a-routing-miss)",
        "lora.affinity": "no request for an adapter reaches an engine (lora.adapters): 4 of 4 "
        "were its own 400 (lora/affinity-prefers-the-engine-running-the-adapter)",
    }
    stop_grace_s = 2.0
    ready_timeout_s = 120.0

    def environment(self) -> Mapping[str, str]:
        return {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "NO_PROXY": "127.0.0.1,localhost",
        }

    async def start_sidecars(self, sidecars: Sidecars, case: Case) -> None:
        if case.discovery is not None:
            raise Unsupported(f"litellm has no {case.discovery} discovery")
        argv = [*FAKE_WORKER_COMMAND, "--host", "127.0.0.1", "--port", "0"]
        child = await sidecars.start(
            [*argv, "--model", WARMUP_MODEL], "warmup-worker", ready_pattern=LISTENING
        )
        match = await child.output.wait_for(LISTENING)  # already printed
        sidecars.values[WARMUP_KEY] = match.group(1).rstrip("/")

    async def wait_ready(self, client: httpx.AsyncClient, url: str, launch: Launch) -> None:
        """Every model is listed, then every route has answered the warm-up model once
        (any answer: the deferred imports ran)."""
        await super().wait_ready(client, url, launch)
        for route, stream in WARMUP_ROUTES:
            body = default_body(route, WARMUP_MODEL, stream)
            for _ in range(3):
                try:
                    await client.post(
                        url + ROUTES[route],
                        json=body,
                        headers=self.auth_headers(launch),
                        timeout=60.0,
                    )
                    break
                except httpx.HTTPError:
                    await trio.sleep(0.1)

    def command(self, launch: Launch) -> list[str]:
        config = launch.workdir / "litellm-config.yaml"
        config.write_text(yaml.safe_dump(self.config(launch), sort_keys=False), encoding="utf-8")
        return [
            str(VENV / "bin" / "litellm"),
            "--config",
            str(config),
            "--host",
            launch.host,
            "--port",
            str(launch.port),
            "--num_workers",
            "1",
        ]

    def config(self, launch: Launch) -> dict[str, Any]:
        """The proxy's config file: the fleet as deployments, the settings as its own."""
        s = launch.case.settings
        model_list = [
            {
                "model_name": worker.spec.model,
                "litellm_params": {
                    "model": f"openai/{worker.spec.model}",
                    "api_base": worker.url + "/v1",
                    "api_key": WORKER_KEY,
                },
                "model_info": {"id": worker.name},
            }
            for worker in launch.workers
        ]
        warmup = launch.sidecars.values.get(WARMUP_KEY)
        if warmup is not None:
            model_list.append(
                {
                    "model_name": WARMUP_MODEL,
                    "litellm_params": {
                        "model": f"openai/{WARMUP_MODEL}",
                        "api_base": warmup + "/v1",
                        "api_key": WORKER_KEY,
                    },
                }
            )
        policy = s.policy or "random"
        strategy = STRATEGIES.get(policy)
        if strategy is None:
            if not launch.observe:
                raise Unsupported(f"litellm has no {policy} routing strategy")
            strategy = STRATEGIES["random"]
            launch.substitute("settings.policy", policy, strategy, "it has no such strategy")
        router: dict[str, Any] = {"routing_strategy": strategy}
        if launch.observe:
            for setting, value in _unmapped(launch.case):
                launch.substitute(setting, value, "its default", "no such setting")
        if s.attempts is not None:
            router["num_retries"] = s.attempts - 1
        b = s.breaker
        if b.threshold == 0:
            router["disable_cooldowns"] = True
        elif b.threshold is not None:
            router["allowed_fails"] = b.threshold - 1
        if b.cooldown_s is not None:
            router["cooldown_time"] = b.cooldown_s
        # Without a master key it refuses to start unless told that no key is meant.
        general: dict[str, Any] = (
            {"master_key": s.api_key}
            if s.api_key is not None
            else {"dangerously_permit_weak_or_unset_master_key": True}
        )
        return {"model_list": model_list, "router_settings": router, "general_settings": general}


def _unmapped(case: Case) -> list[tuple[str, object]]:
    """The case's settings this adapter has no mapping for, with their values."""
    s = case.settings
    candidates: list[tuple[str, object]] = [
        ("settings.max_body_bytes", s.max_body_bytes),
        ("settings.max_concurrent", s.max_concurrent),
        ("settings.queue_size", s.queue_size),
        ("settings.breaker.max_cooldown_s", s.breaker.max_cooldown_s),
        ("settings.breaker.all_open", s.breaker.all_open),
        ("settings.health.interval_s", s.health.interval_s),
        ("settings.health.failure_threshold", s.health.failure_threshold),
        ("settings.health.success_threshold", s.health.success_threshold),
    ]
    return [(name, value) for name, value in candidates if value is not None]

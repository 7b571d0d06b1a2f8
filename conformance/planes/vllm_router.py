"""The vLLM router (`vllm-router` on PyPI, a Rust fork of the SGLang router), launched as
its console script `vllm-router`.

Mapping notes, read from `vllm-router --help` and its defaults, then checked on the binary:
- it binds `--port` (default 30000) and cannot be told port 0, so the runner picks one;
  its Prometheus exporter listens on 127.0.0.1:29000 unless told, so every instance gets
  a free `--prometheus-port` (and host 127.0.0.1);
- `--policy` defaults to cache_aware; round_robin is the neutral default here. There is
  no least-load policy, and consistent hashing is `consistent_hash`;
- `--retry-max-retries` counts total attempts, as in smg; `--cb-*` and `--health-*` are
  smg's flags, in whole seconds;
- PD is `--vllm-pd-disaggregation` with vLLM's NIXL handoff (`--kv-connector nixl` by
  default), not SGLang's bootstrap room that the spec's handoff checks read; the other PD
  cases run (the fake workers answer both legs whatever the handoff), and it refuses to
  start with an empty decode pool;
- DP is one `--intra-node-data-parallel-size` for the whole fleet, and it needs
  `--api-key` (sent to the workers; the fake workers ignore it).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from conformance.model import Case
from conformance.planes.base import Launch, Unsupported
from conformance.planes.smg import ROUTES, SmgPlane

POLICIES = {
    "round_robin": "round_robin",
    "random": "random",
    "power_of_two": "power_of_two",
    "consistent_hash": "consistent_hash",
}
BINARY = "vllm-router"
# What `--api-key` is set to when DP needs one; the fake workers accept any key.
DP_API_KEY = "conformance"


def _binary() -> str:
    """`vllm-router` beside the running interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).with_name(BINARY)
    if beside.exists():
        return str(beside)
    return shutil.which(BINARY) or BINARY


def _interpreter(binary: str) -> str:
    """The interpreter of a console script (its `#!` line), to ask for the version."""
    try:
        with open(binary, "rb") as script:
            first = script.readline().decode("utf-8", "replace").strip()
    except OSError:
        return sys.executable
    return first[2:].split()[0] if first.startswith("#!") and first[2:].strip() else sys.executable


class VllmRouterPlane(SmgPlane):
    name = "vllm-router"
    divergences: ClassVar[Path | None] = Path(__file__).with_name("vllm_router_divergences.yaml")
    grpc_divergences: ClassVar[Path | None] = None
    distribution = "vllm-router"
    install_hint: ClassVar[str] = "pip install vllm-router (make setup installs it)"
    capabilities = frozenset(
        {
            "breaker.all_open_reject",
            "pd",
            "pd.nixl",
            "dp_rank",
            "admission.queue",
            "health.active",
            *(f"policy.{name}" for name in POLICIES),
            # Every route of the engines' APIs, and smg's `--max-payload-size`.
            *(f"route.{name}" for name in ROUTES),
            "limits.body_size",
        }
    )
    # Observed with `conformance run --plane vllm-router --run-unsupported -v`.
    missing_notes: ClassVar[Mapping[str, str]] = {
        "upstream.grpc": "no gRPC path: given grpc:// worker URLs (0.1.17) it treats them "
        "as HTTP hosts, waits 30 s for them to become healthy and exits with an error",
        "breaker.single_probe": "half-open admits every request: 8 concurrent requests just after "
        "the cooldown sent 4 to the half-open worker",
        "stream.resume": "a stream whose worker breaks mid-way is cut, never resumed (vllm-router "
        "0.1.17, the spec/resume cases on fake vLLM workers): the client keeps the text it had, "
        "then the connection closes without the end of the chunked body: no error event, no "
        "[DONE], no usage",
        "breaker.backoff": "the cooldown never grows: about 3 s after a failed probe with a 2 s "
        "cooldown the worker was probed again",
        "breaker.all_open_dispatch": 'with every worker open it answers 503 in plain text ("No '
        'available workers (all circuits open or unhealthy)"), 0 dispatches; no flag dispatches instead',
        "policy.least_load": "--policy offers random, round_robin, cache_aware, kv_aware, power_of_two, "
        "consistent_hash, sticky_least_loaded: no plain least-load",
        "pd.bootstrap": "--vllm-pd-disaggregation hands off with vLLM's NIXL parameters "
        "(--kv-connector nixl|mooncake|moriio), not SGLang's bootstrap room the handoff checks read",
        "worker.status": "static workers have no DRAINING state to learn",
        "model.alias": "no flag of `vllm-router --help` (0.1.17) names a model alias",
        "model.alias_weights": "no model alias at all (0.1.17)",
        "model.fallback": "no flag of `vllm-router --help` (0.1.17) names a fallback model",
        "admission.priority": "--max-concurrent-requests has one FIFO queue; no flag names a "
        "priority class or header (0.1.17)",
        "discovery.etcd": "no etcd discovery (--service-discovery follows Kubernetes Pods)",
        "discovery.kubernetes": "it has --service-discovery (Kubernetes Pods); the Kubernetes cases have not "
        "been mapped to it or run against it yet",
        "policy.cache_aware": "it has a cache_aware policy; the cache_aware cases have not been run against it yet",
        "policy.kv_aware": "it has a kv_aware policy; the kv_aware cases have not been mapped to it or run against it yet",
        "auth.client_key": "its --api-key is the key it sends to workers, not one it asks of clients: "
        "with --api-key set, requests without an Authorization header were served (200) and dispatched",
        # Observed on the lora/ cases (0.1.17): engines listing adapters with parent m.
        "lora.adapters": "it routes an adapter's requests over every worker, whatever they "
        "hold: 6 requests for x went 2/2/2 to three engines of which one holds x, and the other "
        "two answered their own 404 NotFoundError (4 of 6); an unknown adapter cost a dispatch "
        "per request (3 of 3 answered 404 by engines); /v1/models is one engine's list (m and x, "
        "not y, which the other engine held) (lora/adapter-goes-only-to-engines-holding-it, "
        "lora/unknown-adapter-404, lora/adapters-listed-with-parent)",
        "lora.routing_miss": "an engine's 404 for an adapter goes to the client verbatim: 4 of 8 "
        "requests for x got it from the engine that had unloaded x, which kept getting half of "
        "them (lora/unloaded-adapter-is-a-routing-miss)",
        "lora.affinity": "not run: it has no least_load policy, which the case uses "
        "(lora/affinity-prefers-the-engine-running-the-adapter)",
    }
    log_level: ClassVar[str] = "warning"
    pd_flag: ClassVar[str] = "--vllm-pd-disaggregation"

    def version_argv(self) -> list[str]:
        code = "import vllm_router.version as v; print(v.__version__)"
        return [_interpreter(_binary()), "-c", code]

    def check(self, case: Case) -> None:
        super().check(case)
        roles = {worker.role for worker in case.fleet}
        if case.is_pd and not {"prefill", "decode"} <= roles:
            raise Unsupported(
                "vllm-router will not start a PD fleet without both pools "
                '("PD disaggregation mode requires --decode")'
            )
        sizes = {worker.dp_size for worker in case.fleet}
        if len(sizes) > 1:
            raise Unsupported(
                f"workers of dp_size {', '.join(map(str, sorted(sizes)))}: vllm-router takes one "
                "--intra-node-data-parallel-size for the whole fleet"
            )

    def program_argv(self) -> list[str]:
        return [_binary()]

    def fleet_flags(self, launch: Launch) -> list[str]:
        flags: list[str] = []
        dp_size = max(worker.spec.dp_size for worker in launch.workers)
        if dp_size > 1:
            flags += ["--intra-node-data-parallel-size", str(dp_size), "--api-key", DP_API_KEY]
        return flags + self.worker_flags(launch)

    @staticmethod
    def _policy(name: str) -> str:
        if name not in POLICIES:
            raise Unsupported(f"vllm-router has no {name} policy")
        return POLICIES[name]

"""The SGLang Model Gateway (`smg` on PyPI, Rust), launched as `python -m smg launch`.

Mapping notes, each observed on the binary rather than taken from its help text:
- it cannot bind port 0, so the runner picks a free port; its Prometheus exporter also
  listens (default 29000), so every instance gets a free port for that too;
- it admits a worker only once `/health` and `/v1/models` answer 200, so readiness is
  "every fleet URL is listed by `GET /workers` and healthy";
- `--retry-max-retries` counts total attempts, so `attempts` maps to it directly;
- cooldowns and health intervals are whole seconds;
- success threshold is set to 1 so that one good probe closes the breaker, as in the spec;
- under Kubernetes discovery it reads the kubeconfig from `KUBECONFIG` and takes one
  port (`--service-discovery-port`) for every Pod; a Pod that is not Ready is no worker;
- its gRPC path: `--worker-urls grpc://HOST:PORT` (the fleet's URLs on `--fleet grpc` or
  `vllm-grpc`); it asks each engine service's `HealthCheck` to learn the engine's kind,
  loads the tokenizer from the directory `GetModelInfo` names, and tokenizes itself. The
  same flags apply; `smg_grpc_divergences.yaml` lists where that path diverges.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx

from conformance import kube_sidecar
from conformance.fleet import RunningWorker
from conformance.model import Case, RequestSpec
from conformance.planes.base import Launch, Plane, Unsupported, wait_for_answer
from conformance.planes.gateway_flags import (
    auth_and_admission_flags,
    cache_aware_flags,
    health_threshold_flags,
)
from conformance.processes import free_port
from conformance.sidecars import Sidecars

ROUTES = ("completions", "generate", "responses", "messages", "embeddings")
POLICIES = {
    "round_robin": "round_robin",
    "random": "random",
    "least_load": "least_load",
    "power_of_two": "power_of_two",
    "consistent_hash": "consistent_hashing",
    "cache_aware": "cache_aware",
}


class SmgPlane(Plane):
    name = "smg"
    divergences: ClassVar[Path | None] = Path(__file__).with_name("smg_divergences.yaml")
    grpc_divergences: ClassVar[Path | None] = Path(__file__).with_name("smg_grpc_divergences.yaml")
    # Its interpreter names the installed release (`smg --version` says "smg 1.13.0").
    distribution = "smg"
    install_hint: ClassVar[str] = "pip install smg (make setup installs it)"
    capabilities = frozenset(
        {
            "breaker.all_open_reject",
            "pd",
            "pd.bootstrap",
            "dp_rank",
            "auth.client_key",
            "admission.queue",
            "health.active",
            # Through the fake API server a sidecar runs, with a kubeconfig (KUBECONFIG).
            "discovery.kubernetes",
            *(f"policy.{name}" for name in POLICIES),
            # Every route of the engines' APIs, and a body limit (`--max-payload-size`).
            *(f"route.{name}" for name in ROUTES),
            "limits.body_size",
            # --model-alias ALIAS=MODEL (one model, no weights), and the priority scheduler.
            "model.alias",
            "admission.priority",
            # gRPC engines behind it (`--fleet grpc`, `vllm-grpc`).
            "upstream.grpc",
        }
    )
    # Observed with `conformance run --plane smg --run-unsupported -v`.
    missing_notes: ClassVar[Mapping[str, str]] = {
        "breaker.single_probe": "half-open admits every request: 8 concurrent requests just after "
        "the cooldown sent 4 to the half-open worker",
        "breaker.backoff": "the cooldown never grows: 1.4 s after a failed probe with a 1 s "
        "cooldown the worker was probed again",
        "stream.resume": "a stream whose worker breaks mid-way is cut, never resumed (smg 1.13.0, "
        "the spec/resume cases on fake vLLM workers): the client keeps the text it had "
        "('tok0 to' of 'tok0 tok1 tok2 '), then gets an error event "
        '(`{"error": {"type": "stream_error", ...}}`) and `[DONE]`, no usage; one dispatch',
        "breaker.all_open_dispatch": "with every worker open it answers 503 no_available_workers "
        '("All workers are unavailable (circuit breaker open or unhealthy)"), 0 dispatches; '
        "no flag dispatches instead",
        "worker.status": "static workers have no DRAINING state to learn",
        "load.engine": "it reads the engines' loads only about every 10 s: 1.5 s after an engine "
        "reported 8 requests another router sent, least_load sent 3 of 6 requests there "
        "(another run: 1 of 6); with a 12 s wait it sent none (load/engine-load-elsewhere-avoided)",
        "pd.mixed_fleet": "--pd-disaggregation takes prefill and decode workers only",
        "discovery.etcd": "`smg launch --help` offers no etcd discovery (--discovery-provider is kubernetes or file)",
        "model.alias_weights": "--model-alias takes ALIAS=CANONICAL: one served model per alias, "
        "no weight (`smg launch --help`, 1.13.0)",
        "model.fallback": "no flag of `smg launch --help` (1.13.0) names a model to fall back to",
        "cache_aware.smallest_tree": "below --cache-threshold it takes the least loaded worker, "
        "not the one with the smallest tree: with every load 0 a prompt matching 0.26 of worker "
        "a's text (threshold 0.5) went to a in some runs and to b in others, so no count holds",
        # Observed on the lora/ cases (1.13.0): engines listing adapters x, y with parent m.
        "lora.adapters": "it lists and routes the base model only: /v1/models answered m alone, "
        'and every request for adapter x or y was its own 404 model_not_found ("No worker '
        "available for model 'x'\"), 0 dispatches, though engines held them "
        "(lora/adapter-goes-only-to-engines-holding-it)",
        "lora.routing_miss": "no request for an adapter reaches an engine (lora.adapters): 8 of 8 "
        "were its own 404 (lora/unloaded-adapter-is-a-routing-miss)",
        "lora.affinity": "no request for an adapter reaches an engine (lora.adapters): 4 of 4 "
        "were its own 404 (lora/affinity-prefers-the-engine-running-the-adapter)",
    }
    pd_flag: ClassVar[str] = "--pd-disaggregation"
    stop_grace_s = 0.3
    ready_timeout_s = 40.0
    command_prefix: ClassVar[tuple[str, ...]] = (sys.executable, "-m", "smg", "launch")
    log_level: ClassVar[str] = "warn"

    def check(self, case: Case) -> None:
        b = case.settings.breaker
        if b.cooldown_s is not None:
            _whole_seconds(b.cooldown_s, "settings.breaker.cooldown_s")
        if case.settings.health.interval_s is not None:
            _whole_seconds(case.settings.health.interval_s, "settings.health.interval_s")

    def program_argv(self) -> list[str]:
        """What runs the gateway, before its flags."""
        return list(self.command_prefix)

    def command(self, launch: Launch) -> list[str]:
        self.check(launch.case)
        argv = [
            *self.program_argv(),
            "--host",
            launch.host,
            "--port",
            str(launch.port),
            "--prometheus-host",
            launch.host,
            "--prometheus-port",
            str(free_port(launch.host)),
            "--log-level",
            self.log_level,
            "--worker-startup-check-interval",
            "1",
            "--worker-startup-timeout-secs",
            "30",
        ]
        argv += self.fleet_flags(launch)
        argv += self.settings_flags(launch.case)
        if launch.case.settings.priority_classes:
            argv += ["--priority-scheduler-config", str(_scheduler_config(launch))]
        return argv

    async def start_sidecars(self, sidecars: Sidecars, case: Case) -> None:
        if case.discovery == "kubernetes":
            await kube_sidecar.start_fake_kube_api(sidecars)
        elif case.discovery is not None:
            raise Unsupported(f"smg has no {case.discovery} discovery")

    async def publish(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker, status: str
    ) -> None:
        await kube_sidecar.publish(client, launch.sidecars, worker, status)

    async def withdraw(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker
    ) -> None:
        await kube_sidecar.withdraw(client, launch.sidecars, worker)

    def launch_environment(self, launch: Launch) -> Mapping[str, str]:
        if launch.case.discovery != "kubernetes":
            return self.environment()
        return {
            **self.environment(),
            "KUBECONFIG": launch.sidecars.values[kube_sidecar.KUBECONFIG_KEY],
        }

    def fleet_flags(self, launch: Launch) -> list[str]:
        if launch.case.discovery == "kubernetes":
            if launch.case.is_pd:
                raise Unsupported(
                    "the Kubernetes form of PD cases is not mapped to smg's prefill/decode selectors"
                )
            return [
                "--service-discovery",
                "--selector",
                kube_sidecar.SELECTOR,
                "--service-discovery-namespace",
                kube_sidecar.NAMESPACE,
                "--service-discovery-port",
                str(kube_sidecar.shared_port(list(launch.workers))),
            ]
        flags: list[str] = []
        if any(worker.spec.dp_size > 1 for worker in launch.workers):
            flags.append("--dp-aware")
        return flags + self.worker_flags(launch)

    def worker_flags(self, launch: Launch) -> list[str]:
        """The workers as `--worker-urls`, or a PD fleet as `--prefill`/`--decode` pairs."""
        if not launch.case.is_pd:
            return ["--worker-urls", *(worker.url for worker in launch.workers)]
        flags = [self.pd_flag]
        for worker in launch.workers:
            if worker.spec.role == "prefill":
                flags += ["--prefill", worker.url, str(worker.bootstrap_port)]
            elif worker.spec.role == "decode":
                flags += ["--decode", worker.url]
            else:
                raise Unsupported(
                    f"{self.name} serves either a PD fleet or mixed workers, not both at once"
                )
        return flags

    def settings_flags(self, case: Case) -> list[str]:
        s = case.settings
        # smg's own default policy is cache_aware; round_robin is the neutral default.
        flags = ["--policy", self._policy(s.policy or "round_robin")]
        if s.prefill_policy is not None:
            flags += ["--prefill-policy", self._policy(s.prefill_policy)]
        if s.decode_policy is not None:
            flags += ["--decode-policy", self._policy(s.decode_policy)]
        if s.attempts is not None:
            flags += ["--retry-max-retries", str(s.attempts)]
        b = s.breaker
        if b.threshold == 0:
            flags.append("--disable-circuit-breaker")
        else:
            flags += ["--cb-success-threshold", "1"]
            if b.threshold is not None:
                flags += ["--cb-failure-threshold", str(b.threshold)]
            if b.cooldown_s is not None:
                flags += ["--cb-timeout-duration-secs", str(int(b.cooldown_s))]
        h = s.health
        if h.interval_s is not None:
            flags += [
                "--health-check-interval-secs",
                str(int(h.interval_s)),
                "--health-check-timeout-secs",
                "1",
            ]
        flags += health_threshold_flags(h)
        if s.max_body_bytes is not None:
            flags += ["--max-payload-size", str(s.max_body_bytes)]
        flags += cache_aware_flags(s.cache_aware)
        flags += auth_and_admission_flags(s)
        flags += self.traffic_flags(case)
        return flags

    def traffic_flags(self, case: Case) -> list[str]:
        """Aliases (one model each: smg's `--model-alias` has no weights) and the priority
        scheduler, whose classes are its own four (`smg_class`)."""
        s = case.settings
        flags: list[str] = []
        for alias, targets in s.aliases.items():
            if len(targets) != 1:
                raise Unsupported(f"smg's --model-alias names one model; {alias!r} names more")
            flags += ["--model-alias", f"{alias}={next(iter(targets))}"]
        if s.priority_classes:
            _smg_classes(case)
            flags.append("--priority-scheduler-enabled")
        return flags

    def request_headers(self, launch: Launch, request: RequestSpec) -> dict[str, str]:
        if request.priority is None:
            return {}
        return {"x-smg-priority": _smg_classes(launch.case)[request.priority]}

    @staticmethod
    def _policy(name: str) -> str:
        """The plane's own name for a neutral policy (every neutral one exists on smg)."""
        return POLICIES[name]

    async def wait_ready(self, client: httpx.AsyncClient, url: str, launch: Launch) -> None:
        """Every fleet URL is listed by `GET /workers` (as itself or as `URL@rank` under
        `--dp-aware`) and every listed worker is healthy."""
        # Under discovery only the Pods that are Ready at the start are workers yet.
        wanted = {worker.url for worker in launch.workers if worker.spec.status == "active"}

        def lists_every_worker_healthy(answer: Any) -> bool:
            entries = answer.get("workers", [])
            listed = {str(entry.get("url", "")).split("@")[0].rstrip("/") for entry in entries}
            healthy = all(entry.get("is_healthy") for entry in entries)
            return wanted <= listed and healthy

        await wait_for_answer(
            client, url + "/workers", self.auth_headers(launch), lists_every_worker_healthy, 0.1
        )


def _scheduler_config(launch: Launch) -> Path:
    """The scheduler's YAML: no class reserves a slot. Its built-in reservations (observed:
    "sum of class reservations (3) exceeds capacity (1)" with --max-concurrent-requests 1)
    make it fall back to its legacy admission on a small capacity, which has no classes.
    1.13.0 names the fields `reserved_floor` and `reserved_per_slot`, and wants every field
    of a class it lists."""
    path = launch.workdir / "smg-priority.yaml"
    classes = ("system", "interactive", "default", "bulk")
    queue_size = launch.case.settings.queue_size or 100
    path.write_text(
        "classes:\n"
        + "".join(
            f"  {name}:\n"
            "    reserved_floor: 0\n"
            "    reserved_per_slot: 0\n"
            f"    queue_size: {queue_size}\n"
            "    queue_timeout_secs: 60\n"
            # No promotion out of class order and no preemption: the spec has neither.
            "    starvation_threshold_secs: 600\n"
            "    can_preempt: false\n"
            for name in classes
        )
    )
    return path


def _smg_classes(case: Case) -> dict[str, str]:
    """A case's two classes as smg's: the higher, which must be the default, is smg's
    `default` (what a request without the header gets), the lower `bulk`."""
    s = case.settings
    classes = s.priority_classes
    if len(classes) != 2 or s.default_priority != classes[0]:
        raise Unsupported(
            "smg's classes are its own four; a case maps onto them with two classes whose "
            "default is the higher one"
        )
    return {classes[0]: "default", classes[1]: "bulk"}


def _whole_seconds(value: float, field: str) -> None:
    if value < 1 or not math.isclose(value, round(value)):
        raise Unsupported(f"{field} is {value:g}s; smg takes whole seconds (at least 1)")

"""The Python data plane of this repository: `router serve`, launched as a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import httpx
import trio
import yaml

from conformance import etcd_sidecar, kube_sidecar
from conformance.fleet import RunningWorker
from conformance.model import Case, RequestSpec
from conformance.planes.base import Launch, Plane, Unsupported
from conformance.planes.gateway_flags import (
    auth_and_admission_flags,
    cache_aware_flags,
    health_threshold_flags,
)
from conformance.sidecars import Sidecars

VOCABULARY_KEY = "fake_vocabulary"
# `router serve`'s own default, needed to keep an explicit long cooldown valid.
DEFAULT_MAX_COOLDOWN_S = 60.0


class PythonPlane(Plane):
    name = "python"
    divergences: ClassVar[Path | None] = Path(__file__).with_name("python_divergences.yaml")
    distribution = "trio-router"
    install_hint: ClassVar[str] = "pip install -e '.[test]' (make setup installs it)"
    # Where its gRPC path (grpc:// workers: docs/grpc.md) behaves otherwise than the spec.
    grpc_divergences: ClassVar[Path | None] = Path(__file__).with_name(
        "python_grpc_divergences.yaml"
    )
    # Capabilities it lacks, and what it does instead.
    missing_notes: ClassVar[Mapping[str, str]] = {}
    capabilities = frozenset(
        {
            # grpc:// workers (vLLM's engine service): `--fleet grpc`, `vllm-grpc`.
            "upstream.grpc",
            "breaker.single_probe",
            "breaker.backoff",
            "breaker.all_open_dispatch",
            "breaker.all_open_reject",
            "pd",
            "pd.mixed_fleet",
            "dp_rank",
            # `--workers-file` records carry `status: DRAINING`, as an etcd record would.
            "worker.status",
            "auth.client_key",
            "admission.queue",
            "health.active",
            "policy.round_robin",
            "policy.random",
            "policy.least_load",
            "policy.power_of_two",
            "policy.consistent_hash",
            "pd.bootstrap",
            # The plane owns its etcd: a sidecar started for each case that needs one.
            "discovery.etcd",
            # And its fake Kubernetes API server, likewise.
            "discovery.kubernetes",
            "policy.cache_aware",
            "cache_aware.smallest_tree",
            "policy.kv_aware",
            # Its engine load reader (vLLM /metrics, SGLang /v1/loads or its load stream).
            "load.engine",
            # Every route of the engines' APIs, and a body limit (`--max-body-bytes`).
            *(
                f"route.{name}"
                for name in ("completions", "generate", "responses", "messages", "embeddings")
            ),
            "limits.body_size",
            # `--resume-limit`, with the fake fleet's vocabulary as `--kv-tokenizer`.
            "stream.resume",
            # --model-alias (weights too), --model-fallback, --priority-classes.
            "model.alias",
            "model.alias_weights",
            "model.fallback",
            "admission.priority",
            # Adapters learned from the engines' model lists, a 404 for one a routing miss,
            # and the slots of vllm:lora_requests_info in the load policies.
            "lora.adapters",
            "lora.routing_miss",
            "lora.affinity",
        }
    )
    listen_pattern = re.compile(r"router listening on (http://[^\s]+)")
    stop_grace_s = 2.0
    command_prefix: ClassVar[tuple[str, ...]] = (sys.executable, "-m", "router.cli", "serve")

    async def start_sidecars(self, sidecars: Sidecars, case: Case) -> None:
        if case.settings.resume_limit:
            # The text after a resumed stream's seam is made from the fake fleet's token ids
            # with its vocabulary, written as a tokenizer.json by the fake worker's command.
            path = sidecars.workdir / "fake-vocabulary.json"
            await trio.run_process(
                [*self.command_prefix[:-1], "fake-worker", "--write-tokenizer", str(path)],
                stdout=subprocess.DEVNULL,
            )
            sidecars.values[VOCABULARY_KEY] = str(path)
        if case.discovery == "etcd":
            await etcd_sidecar.start_etcd(sidecars)
        elif case.discovery == "kubernetes":
            await kube_sidecar.start_fake_kube_api(sidecars)
        elif case.discovery is not None:
            raise Unsupported(f"discovery {case.discovery} is not built into router serve yet")

    async def publish(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker, status: str
    ) -> None:
        if launch.case.discovery == "kubernetes":
            await kube_sidecar.publish(client, launch.sidecars, worker, status)
        else:
            await etcd_sidecar.put_record(client, launch.sidecars, worker, status)

    async def withdraw(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker
    ) -> None:
        if launch.case.discovery == "kubernetes":
            await kube_sidecar.withdraw(client, launch.sidecars, worker)
        else:
            await etcd_sidecar.delete_record(client, launch.sidecars, worker)

    def command(self, launch: Launch) -> list[str]:
        argv = [
            *self.command_prefix,
            "--host",
            launch.host,
            "--port",
            str(launch.port),
            "--shutdown-grace-s",
            "0",
            "--log-level",
            "info",
        ]
        argv += self.fleet_flags(launch)
        argv += self.settings_flags(launch.case)
        vocabulary = launch.sidecars.values.get(VOCABULARY_KEY)
        if vocabulary is not None:
            argv += ["--kv-tokenizer", vocabulary]
        return argv

    def fleet_flags(self, launch: Launch) -> list[str]:
        if launch.case.discovery == "kubernetes":
            return [
                "--discovery",
                "kubernetes",
                "--k8s-kubeconfig",
                launch.sidecars.values[kube_sidecar.KUBECONFIG_KEY],
                "--k8s-namespace",
                kube_sidecar.NAMESPACE,
                "--k8s-selector",
                kube_sidecar.SELECTOR,
                "--k8s-port",
                str(kube_sidecar.shared_port(list(launch.workers))),
            ]
        if launch.case.discovery == "etcd":
            values = launch.sidecars.values
            return [
                "--discovery",
                "etcd",
                "--etcd-endpoint",
                values[etcd_sidecar.URL_KEY],
                "--etcd-prefix",
                values[etcd_sidecar.PREFIX_KEY],
            ]
        if any(worker.spec.status != "active" for worker in launch.workers):
            path = launch.workdir / "workers.yaml"
            path.write_text(yaml.safe_dump({"workers": [_record(w) for w in launch.workers]}))
            return ["--workers-file", str(path)]
        flags: list[str] = []
        for worker in launch.workers:
            flags += ["--worker", _worker_spec(worker)]
        return flags

    def settings_flags(self, case: Case) -> list[str]:
        """The case's neutral settings as `router serve` flags; unset ones keep our defaults,
        but for the wait for workers: the spec's verdicts (503, 404) are the answer a request
        gets at once, as the other planes give it, so the router's 5 s wait is off."""
        s = case.settings
        flags: list[str] = ["--wait-for-workers-s", "0"]
        if s.policy is not None:
            flags += ["--policy", s.policy]
        prefill = s.prefill_policy or s.policy
        decode = s.decode_policy or s.policy
        if prefill is not None:
            flags += ["--prefill-policy", prefill]
        if decode is not None:
            flags += ["--decode-policy", decode]
        if s.attempts is not None:
            flags += ["--max-attempts", str(s.attempts)]
        b = s.breaker
        if b.threshold is not None:
            flags += ["--breaker-failure-threshold", str(b.threshold)]
        if b.cooldown_s is not None:
            flags += ["--breaker-cooldown-s", f"{b.cooldown_s:g}"]
        max_cooldown = b.max_cooldown_s
        if (
            max_cooldown is None
            and b.cooldown_s is not None
            and b.cooldown_s > DEFAULT_MAX_COOLDOWN_S
        ):
            max_cooldown = b.cooldown_s
        if max_cooldown is not None:
            flags += ["--breaker-max-cooldown-s", f"{max_cooldown:g}"]
        if b.all_open is not None:
            flags += ["--breaker-all-open", b.all_open]
        h = s.health
        if h.interval_s is not None:
            flags += [
                "--health-interval-s",
                f"{h.interval_s:g}",
                "--health-timeout-s",
                f"{min(h.interval_s, 2.0):g}",
            ]
        flags += health_threshold_flags(h)
        if s.max_body_bytes is not None:
            flags += ["--max-body-bytes", str(s.max_body_bytes)]
        flags += cache_aware_flags(s.cache_aware)
        flags += auth_and_admission_flags(s)
        if s.resume_limit is not None:
            flags += ["--resume-limit", str(s.resume_limit)]
        for alias, targets in s.aliases.items():
            weighted = ",".join(f"{model}:{weight:g}" for model, weight in targets.items())
            flags += ["--model-alias", f"{alias}={weighted}"]
        for model, fallbacks in s.fallbacks.items():
            flags += ["--model-fallback", f"{model}={','.join(fallbacks)}"]
        if s.priority_classes:
            flags += ["--priority-classes", ",".join(s.priority_classes)]
            flags += ["--default-priority", str(s.default_priority)]
        return flags

    def request_headers(self, launch: Launch, request: RequestSpec) -> dict[str, str]:
        return {"x-priority": request.priority} if request.priority is not None else {}


def _worker_spec(worker: RunningWorker) -> str:
    spec = worker.spec
    parts = [worker.url, f"model={spec.model}", f"role={spec.role}"]
    if spec.dp_size > 1:
        parts.append(f"dp_size={spec.dp_size}")
    if worker.bootstrap_port is not None:
        parts.append(f"bootstrap_port={worker.bootstrap_port}")
    if spec.engine != "sglang":
        parts.append(f"engine={spec.engine}")
    return ",".join(parts)


def _record(worker: RunningWorker) -> dict[str, object]:
    spec = worker.spec
    record: dict[str, object] = {
        "url": worker.url,
        "model": [spec.model],
        "role": spec.role,
        "dp_size": spec.dp_size,
        "status": spec.status.upper(),
    }
    if worker.bootstrap_port is not None:
        record["bootstrap_port"] = worker.bootstrap_port
    return record

"""A fake Kubernetes API server a plane owns for one case, and the fleet's Pods in it.

The server is the repository's own fake (`tests/support/fake_kube_api.py`, proven against
the official `kubernetes` client), run as a process: `python -m
tests.support.fake_kube_api_process` from the repository root. `conformance` imports
neither `router` nor `tests`, so it reuses the fake by starting it, not by importing it,
rather than keeping a second copy of an API server that could drift from the proven one.
The runner then acts as the control plane and the kubelet, over the API only:

- a worker published `active` is a Running, Ready Pod (POST, or a status PATCH making an
  existing Pod Ready); `not_ready` is the same Pod with its Ready condition False;
- `draining` begins a graceful deletion (DELETE with a long grace period): the Pod gets
  `metadata.deletionTimestamp` and stays Running, as through a preStop sleep. It cannot
  be undone (the schema refuses a case that tries);
- `remove` deletes the Pod at once (DELETE with `gracePeriodSeconds=0`: the DELETED
  event); a later `add` creates a new Pod of the same name with a new uid, as a
  StatefulSet does.

Every Pod carries the label `app=conformance-worker` and, by default, the annotations
this repository's router reads (`default_annotations`: model, role, DP size, and SGLang's
`sglang.ai/bootstrap-port` on a prefill). A plane that reads other labels or annotations
passes its own `PodShape` to `publish`. All the
fleet's workers listen on one port, each on an address of its own (its Pod IP), because
a plane may take one port for every discovered Pod (the SGLang gateway does).
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

import conformance
from conformance.fleet import RunningWorker
from conformance.processes import ProcessFailed
from conformance.sidecars import Sidecars

URL_KEY = "kube_url"
TOKEN_KEY = "kube_token"
KUBECONFIG_KEY = "kube_kubeconfig"
PODS_KEY = "kube_pods"  # worker name -> the status its Pod shows now
NAMESPACE = "default"
LABEL_KEY, LABEL_VALUE = "app", "conformance-worker"
SELECTOR = f"{LABEL_KEY}={LABEL_VALUE}"
DRAIN_GRACE_S = 600  # far longer than a case: a draining Pod leaves only on `remove`
LISTENING = re.compile(r"fake kube api listening on (http://\S+)")
REPOSITORY = Path(conformance.__file__).resolve().parents[1]
SERVER_MODULE = "tests.support.fake_kube_api_process"


async def start_fake_kube_api(sidecars: Sidecars) -> str:
    """Start the fake API server as the sidecar `kube-api` and write a kubeconfig that
    reaches it; its URL. Stores URL, token and kubeconfig path in `sidecars.values`."""
    if not (REPOSITORY / "tests" / "support" / "fake_kube_api_process.py").is_file():
        raise ProcessFailed(
            f"the fake Kubernetes API server is not in {REPOSITORY}/tests/support (a source checkout is needed)"
        )
    token = secrets.token_hex(16)
    argv = [sys.executable, "-m", SERVER_MODULE, "--token", token]
    child = await sidecars.start(
        argv, "kube-api", env={"PYTHONPATH": str(REPOSITORY)}, ready_pattern=LISTENING
    )
    match = await child.output.wait_for(LISTENING)  # already printed
    url = match.group(1).rstrip("/")
    path = sidecars.workdir / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig(url, token)))
    sidecars.values.update(
        {URL_KEY: url, TOKEN_KEY: token, KUBECONFIG_KEY: str(path), PODS_KEY: {}}
    )
    return url


def kubeconfig(url: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "conformance", "cluster": {"server": url}}],
        "users": [{"name": "plane", "user": {"token": token}}],
        "contexts": [
            {
                "name": "conformance",
                "context": {"cluster": "conformance", "user": "plane", "namespace": NAMESPACE},
            }
        ],
        "current-context": "conformance",
    }


def shared_port(workers: list[RunningWorker]) -> int:
    """The one port every worker of a Kubernetes fleet listens on."""
    ports = {urlsplit(worker.url).port for worker in workers}
    if len(ports) != 1 or None in ports:
        raise ProcessFailed(
            f"a Kubernetes fleet listens on one port; got {sorted(map(str, ports))}"
        )
    port = ports.pop()
    assert port is not None
    return port


def default_annotations(worker: RunningWorker) -> dict[str, str]:
    """The annotations this repository's router reads from a worker's Pod."""
    spec = worker.spec
    out = {
        "trio-router/model": spec.model,
        "trio-router/role": spec.role,
        "trio-router/dp-size": str(spec.dp_size),
    }
    if spec.role == "prefill" and worker.bootstrap_port is not None:
        out["sglang.ai/bootstrap-port"] = str(worker.bootstrap_port)
    return out


@dataclass(frozen=True, slots=True)
class PodShape:
    """What a plane reads on a worker's Pod beyond its phase, address and readiness:
    labels on top of the selector's (`app=conformance-worker` is always there, so the
    plane's selector finds every Pod), and the annotations, a function of the worker."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Callable[[RunningWorker], Mapping[str, str]] = default_annotations


DEFAULT_SHAPE = PodShape()


def pod(
    worker: RunningWorker, ready: bool, generation: int, shape: PodShape = DEFAULT_SHAPE
) -> dict[str, Any]:
    """The worker's Pod: Running at the worker's address, Ready or not."""
    spec = worker.spec
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": spec.name,
            "namespace": NAMESPACE,
            "uid": f"conformance-{spec.name}-{generation}",
            "labels": {**shape.labels, LABEL_KEY: LABEL_VALUE},
            "annotations": dict(shape.annotations(worker)),
        },
        "spec": {"containers": [{"name": "engine", "image": "fake-worker"}]},
        "status": {
            "phase": "Running",
            "podIP": urlsplit(worker.url).hostname,
            "conditions": [_ready(ready)],
        },
    }


def _ready(ready: bool) -> dict[str, str]:
    return {"type": "Ready", "status": "True" if ready else "False"}


async def publish(
    client: httpx.AsyncClient,
    sidecars: Sidecars,
    worker: RunningWorker,
    status: str,
    shape: PodShape = DEFAULT_SHAPE,
) -> None:
    """Make the worker's Pod show `status` (`active`, `not_ready` or `draining`); a new
    Pod gets the plane's `shape`."""
    pods: dict[str, str] = sidecars.values[PODS_KEY]
    name = worker.spec.name
    now = pods.get(name)
    if now == "draining":
        raise ProcessFailed(
            f"pod {name} is terminating; a deletion cannot be undone (remove and add it)"
        )
    if status == "draining":
        if now is None:
            raise ProcessFailed(f"pod {name} does not exist, so it cannot begin terminating")
        await _call(client, sidecars, "DELETE", f"/{name}?gracePeriodSeconds={DRAIN_GRACE_S}")
    elif now is None:
        generation = sidecars.values.setdefault(f"kube_generation_{name}", 0) + 1
        sidecars.values[f"kube_generation_{name}"] = generation
        await _call(
            client, sidecars, "POST", "", pod(worker, status == "active", generation, shape)
        )
    else:
        await _call(
            client,
            sidecars,
            "PATCH",
            f"/{name}/status",
            {"status": {"conditions": [_ready(status == "active")]}},
        )
    pods[name] = status


async def withdraw(client: httpx.AsyncClient, sidecars: Sidecars, worker: RunningWorker) -> None:
    """Delete the worker's Pod at once (the DELETED event)."""
    pods: dict[str, str] = sidecars.values[PODS_KEY]
    if pods.pop(worker.spec.name, None) is not None:
        await _call(client, sidecars, "DELETE", f"/{worker.spec.name}?gracePeriodSeconds=0")


async def _call(
    client: httpx.AsyncClient,
    sidecars: Sidecars,
    method: str,
    tail: str,
    payload: dict[str, Any] | None = None,
) -> None:
    url = f"{sidecars.values[URL_KEY]}/api/v1/namespaces/{NAMESPACE}/pods{tail}"
    headers = {"authorization": f"Bearer {sidecars.values[TOKEN_KEY]}"}
    if method == "PATCH":
        headers["content-type"] = "application/merge-patch+json"
    try:
        response = await client.request(method, url, json=payload, headers=headers, timeout=5.0)
    except httpx.HTTPError as exc:
        raise ProcessFailed(f"kube api {method} {tail or '/'}: {exc!r}") from None
    if response.status_code not in (200, 201):
        raise ProcessFailed(
            f"kube api {method} {tail or '/'}: {response.status_code} {response.text[:200]}"
        )

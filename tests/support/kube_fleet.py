"""Fake workers standing in for Pods of a fake Kubernetes API server.

All fake workers listen on 127.0.0.1, each on its own port, so a Pod says its port with
the `trio-router/port` annotation (what a Pod whose engine is not on `--k8s-port` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from router.discovery.kube_pods import (
    DP_SIZE_ANNOTATION,
    ENGINE_ANNOTATION,
    MODEL_ANNOTATION,
    PORT_ANNOTATION,
)
from tests.support.fake_fleet import FakeWorkerHandle
from tests.support.fake_kube_api import FakeKubeApi, make_pod


def write_kubeconfig(directory: Path, api: FakeKubeApi, *, token_file: Path | None = None) -> Path:
    """A kubeconfig whose current context reaches `api` with its token (inline, or from
    `token_file`)."""
    user: dict[str, Any] = {"tokenFile": str(token_file)} if token_file else {"token": api.token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "router", "user": user}],
        "contexts": [
            {
                "name": "fake",
                "context": {"cluster": "fake", "user": "router", "namespace": "default"},
            }
        ],
        "current-context": "fake",
    }
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def worker_pod(
    handle: FakeWorkerHandle,
    name: str,
    labels: dict[str, str],
    *,
    ready: bool = True,
    facts_in_annotations: bool = True,
    **annotations: str,
) -> dict[str, Any]:
    """A Pod for `handle`; with `facts_in_annotations` its model, DP size and engine kind
    are annotated (so the router needs no question to the engine), else left to the engine."""
    notes = {PORT_ANNOTATION: str(handle.port), **annotations}
    if facts_in_annotations:
        notes.setdefault(MODEL_ANNOTATION, handle.settings.model)
        notes.setdefault(DP_SIZE_ANNOTATION, str(handle.settings.dp_size))
        notes.setdefault(ENGINE_ANNOTATION, handle.settings.engine)
    return make_pod(name, labels=labels, annotations=notes, ready=ready)

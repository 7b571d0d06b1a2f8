"""Kubernetes objects as the fake API server stores and sends them: Pods, Status answers,
equality label selectors."""

from __future__ import annotations

import copy
import datetime
from typing import Any


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_pod(
    name: str,
    *,
    ip: str | None = "127.0.0.1",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ready: bool = True,
    phase: str = "Running",
    namespace: str = "default",
) -> dict[str, Any]:
    """A Pod object with what discovery reads: labels, annotations, phase, IP, Ready."""
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
            "creationTimestamp": now_rfc3339(),
        },
        "spec": {"containers": [{"name": "engine", "image": "engine:fake"}]},
        "status": status,
    }


def matches_selector(pod: dict[str, Any] | None, selector: dict[str, str]) -> bool:
    if pod is None:
        return False
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


def parse_selector(raw: str) -> dict[str, str]:
    terms: dict[str, str] = {}
    for term in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = term.partition("=")
        if not sep:
            raise ValueError(f"unsupported selector term {term!r}")
        terms[key.strip()] = value.lstrip("=").strip()
    return terms


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def merge_status_patch(pod: dict[str, Any], patch: Any) -> dict[str, Any]:
    """`pod` with a JSON merge patch `{"status": {...}}` applied to its status (a key set to
    null is removed, a list replaced whole); TypeError/KeyError when it is not one."""
    changes = patch["status"]
    if not isinstance(changes, dict):
        raise TypeError("status is not an object")
    after = copy.deepcopy(pod)
    for key, value in changes.items():
        if value is None:
            after["status"].pop(key, None)
        else:
            after["status"][key] = value
    return after

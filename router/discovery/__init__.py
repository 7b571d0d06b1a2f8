"""Where the fleet comes from: static flags and files, etcd, or Kubernetes Pods."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DiscoveryHealth:
    """What `/health` says about the discovery source. `up` is False while it is unreachable
    and the router routes to the last fleet it knew."""

    source: str
    up: bool = True
    detail: str = ""

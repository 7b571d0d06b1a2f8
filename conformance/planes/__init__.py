"""Plane adapters by name. A third binary is one more module and one more line here, or
`--plane some.module:SomePlane` on the command line without touching this file."""

from __future__ import annotations

import importlib

from conformance.planes.base import Launch, Plane, Unsupported
from conformance.planes.litellm import LiteLLMPlane
from conformance.planes.python import PythonPlane
from conformance.planes.smg import SmgPlane
from conformance.planes.smg_1_10 import Smg110Plane
from conformance.planes.vllm_router import VllmRouterPlane

PLANES: dict[str, type[Plane]] = {
    PythonPlane.name: PythonPlane,
    SmgPlane.name: SmgPlane,
    VllmRouterPlane.name: VllmRouterPlane,
    LiteLLMPlane.name: LiteLLMPlane,
}
# Older releases kept to show a fix, run by name only: `--plane all` leaves them out.
PINNED_PLANES: dict[str, type[Plane]] = {
    Smg110Plane.name: Smg110Plane,
}

__all__ = ["PINNED_PLANES", "PLANES", "Launch", "Plane", "Unsupported", "resolve_plane"]


def resolve_plane(spec: str) -> Plane:
    """A registered plane by name, or `module:Class` imported on the spot."""
    if spec in PLANES:
        return PLANES[spec]()
    if spec in PINNED_PLANES:
        return PINNED_PLANES[spec]()
    module_name, sep, class_name = spec.partition(":")
    if not sep:
        names = ", ".join([*PLANES, *PINNED_PLANES])
        raise ValueError(f"unknown plane {spec!r}: choose {names} or give module:Class")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Plane)):
        raise ValueError(f"{spec!r} is not a Plane subclass")
    return cls()

"""Plane adapters by name. A third binary is one more module and one more line here, or
`--plane some.module:SomePlane` on the command line without touching this file."""

from __future__ import annotations

import importlib

from conformance.planes.base import Launch, Plane, Unsupported
from conformance.planes.litellm import LiteLLMPlane
from conformance.planes.python import PythonPlane
from conformance.planes.smg import SmgPlane
from conformance.planes.vllm_router import VllmRouterPlane

PLANES: dict[str, type[Plane]] = {
    PythonPlane.name: PythonPlane,
    SmgPlane.name: SmgPlane,
    VllmRouterPlane.name: VllmRouterPlane,
    LiteLLMPlane.name: LiteLLMPlane,
}

__all__ = ["PLANES", "Launch", "Plane", "Unsupported", "resolve_plane"]


def resolve_plane(spec: str) -> Plane:
    """A registered plane by name, or `module:Class` imported on the spot."""
    if spec in PLANES:
        return PLANES[spec]()
    module_name, sep, class_name = spec.partition(":")
    if not sep:
        raise ValueError(f"unknown plane {spec!r}: choose {', '.join(PLANES)} or give module:Class")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Plane)):
        raise ValueError(f"{spec!r} is not a Plane subclass")
    return cls()

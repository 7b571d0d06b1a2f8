"""Which models an engine serves, and which LoRA adapters it holds: its OpenAI-style model
list.

vLLM lists each base model it serves with `parent` null, and each LoRA adapter it holds
(loaded at start with `--lora-modules`, or at run time) as an entry of its own whose
`parent` names the base model the adapter applies to. An engine that lists no `parent`
at all (SGLang, most others) lists base models only, as far as the router can tell.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class ModelList:
    """One `/v1/models` answer: the base models in the engine's order, and the adapters
    it holds, each with the base model it applies to."""

    models: tuple[str, ...]
    adapters: Mapping[str, str] = field(default_factory=dict)


def parse_model_list(body: Any) -> ModelList:
    """The base models and adapters of a `/v1/models` answer. An entry is an adapter when
    its `parent` is a non-empty string other than its own id; an entry without a string
    `id` is left out.

    Raises ValueError for an answer that is not an OpenAI model list at all.
    """
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("the answer is not an OpenAI model list")
    models: list[str] = []
    adapters: dict[str, str] = {}
    for entry in data:
        if not isinstance(entry, dict):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if not isinstance(name, str) or not name:
            continue
        if isinstance(parent, str) and parent and parent != name:
            adapters[name] = parent
        elif name not in models:
            models.append(name)
    return ModelList(tuple(models), adapters)


async def fetch_model_list(
    http: httpx.AsyncClient, url: str, timeout_s: float = 5.0, *, api_key: str | None = None
) -> ModelList:
    """A worker's `/v1/models`, asked with the router's key for the worker when it has
    one (engines guard `/v1/*` with it).

    Raises httpx.HTTPError, or ValueError for an answer that is not a model list.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    response = await http.get(url + "/v1/models", timeout=timeout_s, headers=headers)
    response.raise_for_status()
    try:
        return parse_model_list(response.json())
    except ValueError as exc:
        raise ValueError(f"{url}/v1/models: {exc}") from None


async def fetch_models(
    http: httpx.AsyncClient, url: str, timeout_s: float = 5.0, *, api_key: str | None = None
) -> tuple[str, ...]:
    """The base model ids a worker serves (its adapters are not models of their own:
    `router.engines.adapter_lists` learns them).

    Raises httpx.HTTPError, or ValueError for an answer that names no model: whatever a
    worker answers, it costs the router that worker only, never the discovery task.
    """
    listing = await fetch_model_list(http, url, timeout_s, api_key=api_key)
    if not listing.models:
        raise ValueError(f"{url}/v1/models lists no model")
    return listing.models

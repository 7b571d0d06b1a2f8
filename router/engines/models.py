"""Which models an engine serves: its OpenAI-style model list."""

from __future__ import annotations

import httpx


async def fetch_models(
    http: httpx.AsyncClient, url: str, timeout_s: float = 5.0, *, api_key: str | None = None
) -> tuple[str, ...]:
    """The model ids a worker serves, from its OpenAI-style `/v1/models` (asked with the
    router's key for the worker, when it has one: engines guard `/v1/*` with it).

    Raises httpx.HTTPError, or ValueError for an answer that names no model: whatever a
    worker answers, it costs the router that worker only, never the discovery task.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    response = await http.get(url + "/v1/models", timeout=timeout_s, headers=headers)
    response.raise_for_status()
    answer = response.json()
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"{url}/v1/models is not an OpenAI model list")
    models = tuple(
        entry["id"]
        for entry in data
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]
    )
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return models

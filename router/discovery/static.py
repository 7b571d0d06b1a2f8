"""Static discovery: the workers named by flags or a fleet file.

A record that names no model is asked for it (`GET /v1/models`); a worker that cannot
answer yet joins the fleet as soon as it can.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import httpx
import trio

from router.discovery import DiscoveryHealth
from router.discovery.backoff import Backoff
from router.worker_record import WorkerRecord
from router.workers import Fleet

log = logging.getLogger("router.discovery.static")


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


async def serve_static_discovery(
    fleet: Fleet,
    records: Sequence[WorkerRecord],
    http: httpx.AsyncClient,
    *,
    retry_interval_s: float = 1.0,
    max_retry_interval_s: float = 30.0,
    worker_api_key: str = "",
    task_status: trio.TaskStatus[DiscoveryHealth] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Put `records` in the fleet; ready once every worker had one chance to name its model.

    Workers whose model is still unknown are retried, `retry_interval_s` doubling up to
    `max_retry_interval_s` (an engine loading weights can take minutes), until they answer;
    then the task returns.
    """
    pending: list[WorkerRecord] = []
    for record in records:
        if record.models:
            fleet.upsert(record)
        else:
            pending.append(record)
    health = DiscoveryHealth(source="static")

    async def resolve(record: WorkerRecord) -> bool:
        try:
            models = await fetch_models(
                http, record.url, api_key=record.api_key or worker_api_key or None
            )
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("worker %s: cannot read its model yet (%s); retrying", record.url, exc)
            return False
        fleet.upsert(dataclasses.replace(record, models=models))
        log.info("worker %s serves %s", record.url, ", ".join(models))
        return True

    resolved: set[str] = set()

    async def attempt(record: WorkerRecord) -> None:
        if await resolve(record):
            resolved.add(record.id)

    backoff = Backoff(retry_interval_s, max_retry_interval_s)
    first = True
    while pending:
        async with trio.open_nursery() as nursery:
            for record in pending:
                nursery.start_soon(attempt, record)
        pending = [record for record in pending if record.id not in resolved]
        if first:
            task_status.started(health)
            first = False
        if pending:
            await trio.sleep(backoff.failure())
    if first:
        task_status.started(health)

"""Static discovery: the workers named by flags (`--worker URL,role=...`) or a fleet file.

A record that names no model is asked for it (`GET /v1/models`; a `grpc://` worker's
`GetModelInfo`); a worker that cannot answer yet joins the fleet as soon as it can.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio
import yaml

from router.discovery import DiscoveryHealth
from router.engines.grpc_service import GrpcFactsUnavailable, GrpcMessagesMissing, model_info
from router.engines.models import fetch_models
from router.fleet.records import InvalidWorkerRecord, WorkerRecord, disagg_meta
from router.fleet.registry import Fleet
from router.http.backoff import Backoff
from router.http.grpc import GrpcPool

log = logging.getLogger("router.discovery.static")
GRPC_TIMEOUT_S = 5.0


async def _grpc_models(grpc: GrpcPool | None, url: str) -> tuple[str, ...]:
    """A gRPC worker's served model (`GetModelInfo`)."""
    if grpc is None:
        raise ValueError("this router has no gRPC pool")
    try:
        info = await model_info(grpc, url, GRPC_TIMEOUT_S)
    except GrpcMessagesMissing as exc:
        raise ValueError(str(exc)) from None
    if not info.served_model_name:
        raise ValueError("GetModelInfo names no served model")
    return (info.served_model_name,)


async def serve_static_discovery(
    fleet: Fleet,
    records: Sequence[WorkerRecord],
    http: httpx.AsyncClient,
    *,
    retry_interval_s: float = 1.0,
    max_retry_interval_s: float = 30.0,
    worker_api_key: str = "",
    grpc: GrpcPool | None = None,
    task_status: trio.TaskStatus[DiscoveryHealth] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Put `records` in the fleet; ready once every worker had one chance to name its model
    (a `grpc://` worker asked through `grpc`).

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
            if record.is_grpc:
                models = await _grpc_models(grpc, record.url)
            else:
                models = await fetch_models(
                    http, record.url, api_key=record.api_key or worker_api_key or None
                )
        except (httpx.HTTPError, ValueError, GrpcFactsUnavailable) as exc:
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


def parse_worker_spec(spec: str) -> WorkerRecord:
    """`URL[,role=R,model=M,adapters=A+B,bootstrap_port=P,dp_size=N,dp_rank=K,engine=E]`
    -> WorkerRecord."""
    url, *pairs = [part.strip() for part in spec.split(",")]
    data: dict[str, Any] = {"url": url, "id": url.rstrip("/")}
    bootstrap_port: str | None = None
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise InvalidWorkerRecord(f"--worker {spec!r}: expected key=value, got {pair!r}")
        if key in ("role", "engine", "id"):
            data[key] = value
        elif key in ("model", "adapters"):
            data[key] = value.split("+")
        elif key in ("dp_size", "dp_rank"):
            data[key] = _spec_int(spec, key, value)
        elif key == "bootstrap_port":
            bootstrap_port = str(_spec_int(spec, key, value))
        else:
            raise InvalidWorkerRecord(
                f"--worker {spec!r}: unknown option {key!r} "
                "(role, model, adapters, bootstrap_port, dp_size, dp_rank, engine, id)"
            )
    if bootstrap_port is not None:
        host = urlsplit(url).hostname or "127.0.0.1"
        data["disagg_meta"] = disagg_meta(host, bootstrap_port)
    return _record(data, f"--worker {spec!r}")


def _spec_int(spec: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidWorkerRecord(
            f"--worker {spec!r}: {key} must be an integer, got {value!r}"
        ) from None


def read_workers_file(path: Path) -> list[WorkerRecord]:
    """A YAML list of worker records (the JSON shape of DESIGN.md "Workers")."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidWorkerRecord(f"workers file {path}: {exc}") from None
    if isinstance(data, dict) and "workers" in data:
        data = data["workers"]
    return records_from_list(data, str(path))


def records_from_list(data: Any, source: str) -> list[WorkerRecord]:
    if not isinstance(data, list):
        raise InvalidWorkerRecord(f"{source}: workers must be a list of records")
    records = []
    for index, entry in enumerate(data):
        if isinstance(entry, str):
            records.append(parse_worker_spec(entry))
            continue
        if isinstance(entry, dict) and "bootstrap_port" in entry and "disagg_meta" not in entry:
            host = urlsplit(str(entry.get("url", ""))).hostname or "127.0.0.1"
            entry = {**entry, "disagg_meta": disagg_meta(host, entry["bootstrap_port"])}
        records.append(_record(entry, f"{source}: worker #{index + 1}"))
    return records


def _record(data: Any, source: str) -> WorkerRecord:
    try:
        return WorkerRecord.from_json(data)
    except InvalidWorkerRecord as exc:
        raise InvalidWorkerRecord(f"{source}: {exc}") from None

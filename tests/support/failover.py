"""A router over fake workers, and what failover cost it: the tests of failover and the
breaker (chat and the other routes) assert on dispatch counts, breaker statistics and the
router's retry counter, read here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.cli.serve import RunningRouter
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.breaker import BreakerStatistics
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

MODEL = "fake-model"
# A cooldown far beyond any test, so no probe happens while one runs.
NO_PROBE: dict[str, Any] = {
    "policy": "round_robin",
    "breaker_cooldown_s": 60.0,
    "breaker_max_cooldown_s": 60.0,
}


def spec(url: str) -> str:
    # Naming the model keeps the fleet in the order given (round robin's order) and spares
    # a worker that cannot answer `/v1/models` from being asked.
    return f"{url},model={MODEL}"


@asynccontextmanager
async def fleet_behind_router(
    settings: int | Sequence[FakeWorkerSettings],
    *,
    client_timeout_s: float = 5.0,
    **overrides: Any,
) -> AsyncIterator[tuple[list[FakeWorkerHandle], RunningRouter, httpx.AsyncClient]]:
    """Fake workers with `settings`, a router over them in that (round-robin) order with
    the settings `overrides`, and a client of the router."""
    async with (
        open_fake_fleet(settings) as fleet,
        open_router([spec(w.url) for w in fleet], **overrides) as router,
        httpx.AsyncClient(base_url=router.url, timeout=client_timeout_s) as client,
    ):
        yield fleet, router, client


def breaker_of(router: RunningRouter, url: str) -> BreakerStatistics:
    worker = router.fleet.get(url)
    assert worker is not None and worker.breaker is not None
    return worker.breaker.statistics(trio.current_time())


def dispatches(handle: FakeWorkerHandle) -> int:
    return handle.worker.routing.dispatches


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample called `name` in a /metrics page, keyed by its sorted labels."""
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def scrape(client: httpx.AsyncClient, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return metric_samples(response.text, name)


async def retries(client: httpx.AsyncClient) -> dict[str, float]:
    return {
        dict(labels)["reason"]: value
        for labels, value in (await scrape(client, "router_retries_total")).items()
    }

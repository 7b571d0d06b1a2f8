"""The Grafana dashboard queries only metrics the router exports, and shows what an
operator looks at first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "router.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs, "the dashboard queries nothing"
    return {name for expr in exprs for name in re.findall(r"\brouter_[a-z0-9_]+", expr)}


def _exported_series(scrape: str) -> set[str]:
    """Every series name a scrape can carry, from each family's type (a labelled counter
    with no sample yet still declares itself)."""
    names = set()
    for family in text_string_to_metric_families(scrape):
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


async def test_every_metric_the_dashboard_queries_is_exported() -> None:
    with trio.fail_after(20):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([fleet[0].url], max_concurrent_requests=4) as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as client:
                body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
                scrape = (await client.get("/metrics")).text
    queried = _queried_metrics()
    assert sorted(queried - _exported_series(scrape)) == []


def test_the_dashboard_shows_the_operators_first_questions() -> None:
    queried = _queried_metrics()
    for name in (
        "router_requests_total",
        "router_request_duration_seconds_bucket",
        "router_time_to_first_byte_seconds_bucket",
        "router_worker_inflight",
        "router_admission_queue_depth",
        "router_worker_breaker_state",
        "router_worker_breaker_trips_total",
        "router_retries_total",
        "router_discovery_up",
    ):
        assert name in queried, name

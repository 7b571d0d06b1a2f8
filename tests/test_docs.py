"""The operator documents cannot fall behind the code: every flag, every variable, every
metric the router exports is in them, and nothing they list is gone from the code."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.cli.config import describe_options
from router.cli.serve import build_parser
from tests.support.fake_fleet import open_fake_fleet
from tests.support.router_instance import open_router

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _code_spans(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def test_every_serve_flag_and_variable_is_in_operations_md() -> None:
    documented = _code_spans((DOCS / "operations.md").read_text())
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", build_parser().format_help())) - {"--help"}
    assert flags, "no flag found in the help text"
    assert sorted(flags - documented) == []
    variables = {env for _, env, _, _ in describe_options()}
    assert sorted(variables - documented) == []


def test_operations_md_lists_no_flag_the_router_lacks() -> None:
    text = (DOCS / "operations.md").read_text()
    table_flags = set(re.findall(r"^\| `(--[a-z][a-z0-9-]+)` \|", text, re.M))
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", build_parser().format_help()))
    assert table_flags == flags - {"--help"}


def _exported(text: str) -> set[str]:
    """Metric names as a scrape shows them (`_total` for counters), without the
    `<name>_created` companions prometheus-client adds to counters and histograms."""
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    names = set()
    for name, kind in families.items():
        base = name.removesuffix("_created")
        if base != name and families.get(base) in ("counter", "histogram"):
            continue
        names.add(name + "_total" if kind == "counter" else name)
    return names


async def test_every_metric_the_router_exports_is_in_metrics_md() -> None:
    with trio.fail_after(20):
        async with open_fake_fleet(1) as fleet, open_router([fleet[0].url]) as router:
            async with httpx.AsyncClient(base_url=router.url) as client:
                body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
                scrape = (await client.get("/metrics")).text
    exported = _exported(scrape)
    assert {"router_requests_total", "router_worker_inflight", "router_workers"} <= exported
    text = (DOCS / "metrics.md").read_text()
    documented = _code_spans(text)
    assert sorted(exported - documented) == []
    # and the tables list nothing the router no longer exports
    listed = set(re.findall(r"^\| `(router_[a-z_]+)` \|", text, re.M))
    assert sorted(listed - exported) == []
    assert fleet[0].worker.routing.dispatches == 1

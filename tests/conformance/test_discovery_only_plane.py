"""A plane whose router takes no worker on its command line runs the spec through the
`prepare` hook: its records, in its own shape, are written before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from conformance.loader import load_cases, select_cases
from conformance.runner import RunOptions, run_suite
from tests.conformance.discovery_only_plane import DiscoveryOnlyPlane

ROOT = Path(__file__).resolve().parents[2]
# The etcd cases, and static ones: plain failover, and a record that says DRAINING.
CASES = [
    "discovery/etcd/*",
    "failover/5xx-fails-over",
    "classification/draining-worker-skipped",
]


@pytest.mark.etcd
async def test_a_discovery_only_plane_passes_the_etcd_cases_and_static_ones() -> None:
    loaded = load_cases([ROOT / "spec"], ROOT / "spec")
    cases = select_cases(loaded.cases, CASES, [])
    assert len(cases) == 5
    # Its command line names no worker, so a static case that passes was served from
    # the records `prepare` wrote.
    plane = DiscoveryOnlyPlane()
    with trio.fail_after(240):
        outcomes = await run_suite(cases, [plane], {}, RunOptions(jobs=3))
    verdicts = {o.case_id: (o.verdict, o.detail, o.failures) for o in outcomes}
    assert {case_id: v[0] for case_id, v in verdicts.items()} == dict.fromkeys(
        (case.id for case in cases), "pass"
    ), verdicts

"""`python -m bench.kubernetes_discovery` runs: two runs, each figure measured (not judged:
performance is measured in bench/, never asserted in tests)."""

from __future__ import annotations

import trio

from bench.kubernetes_discovery import measure


async def test_the_kubernetes_discovery_bench_measures_both_figures() -> None:
    with trio.fail_after(60):
        results = await measure(2)
    assert sorted(results) == [
        "Ready -> first request routed",
        "deletionTimestamp -> out of routing",
    ]
    assert all(len(values) == 2 and all(v >= 0 for v in values) for values in results.values())

"""The soak, short: ten seconds of 200 concurrent streams through a real router process,
against a resetting worker, a 503-wedged one and one that breaks every stream mid-way, a
fifth of the clients leaving early.
`make soak` runs the long version and `docs/reliability.md` holds its figures."""

from __future__ import annotations

import math

import trio

from tests.adversarial.soak import run_soak

DURATION_S = 10
STREAMS = 200
BREAKER_COOLDOWN_S = 5.0  # the router's default (`--breaker-cooldown-s`)


async def test_ten_second_soak_loses_nothing_and_keeps_nothing() -> None:
    with trio.fail_after(120):
        report = await run_soak(duration_s=DURATION_S, streams=STREAMS)
    assert report.problems() == []
    assert report.sent > 200 and report.left_by_client > 0
    # Every stream the breaking worker cut and could resume, did; those it cut with two
    # choices ended with the error event, counted as refused for that reason.
    assert report.envelope_ended_early == 0
    assert report.resumes.get("resumed", 0) > 0
    assert set(report.refusals) <= {"n"}
    # Each refusal the router counts ends a stream with the error event, unless its client
    # left before reading it.
    refused = report.refusals.get("n", 0)
    assert report.outside_ended_with_error <= refused
    assert refused <= report.outside_ended_with_error + report.left_by_client
    # Round robin without breakers would send a quarter of all first attempts to each bad
    # worker; the breakers keep them to the first burst (at most one request per client
    # in flight) and the probes after it: one per cooldown (5 s, doubling on failure).
    probes = math.ceil(DURATION_S / BREAKER_COOLDOWN_S) + 1
    for first_burst, total in (
        (report.first_burst_at_reset_worker, report.dispatches_at_reset_worker),
        (report.first_burst_at_wedged_worker, report.dispatches_at_wedged_worker),
    ):
        assert first_burst is not None, "the breaker never opened"
        assert first_burst <= STREAMS
        assert total - first_burst <= probes, (first_burst, total)

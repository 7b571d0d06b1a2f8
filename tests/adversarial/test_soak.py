"""The soak, short: ten seconds of 200 concurrent streams through a real router process,
against a resetting worker and a 503-wedged one, a fifth of the clients leaving early.
`make soak` runs the long version and `docs/reliability.md` holds its figures."""

from __future__ import annotations

import trio

from tests.adversarial.soak import run_soak


async def test_ten_second_soak_loses_nothing_and_keeps_nothing() -> None:
    with trio.fail_after(120):
        report = await run_soak(duration_s=10, streams=200)
    assert report.problems() == []
    assert report.sent > 200 and report.left_by_client > 0
    # Round robin without breakers would send a quarter of all first attempts to each bad
    # worker; the breakers keep them to the first burst and the probes.
    assert report.dispatches_at_reset_worker < report.sent * 0.1
    assert report.dispatches_at_wedged_worker < report.sent * 0.1

"""Waiting for a counter another task or process moves.

The fake workers and the router expose counters, not events, so a test that needs "the
worker has seen the disconnect" polls. Always call it under a `trio.fail_after` guard.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


async def wait_until(condition: Callable[[], bool], *, interval_s: float = 0.005) -> None:
    """Return once `condition()` holds, checking every `interval_s`."""
    while not condition():  # noqa: ASYNC110 - counters, not events, are what the fakes offer
        await trio.sleep(interval_s)

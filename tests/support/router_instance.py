"""Start a router in-process on 127.0.0.1:0 for a test, and stop it afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from router.cli.config import Settings
from router.cli.serve import RunningRouter, run_router
from router.discovery.static import parse_worker_spec


@asynccontextmanager
async def open_router(
    worker_specs: Sequence[str] = (), **overrides: Any
) -> AsyncIterator[RunningRouter]:
    """A router in front of `worker_specs` (the `--worker` syntax), with settings overrides.

    Health checks default to a long interval so a test sees only the traffic it sends, and
    a request that finds no worker is answered at once (no `--wait-for-workers-s`) unless
    the test asks for the wait.
    """
    overrides.setdefault("port", 0)
    overrides.setdefault("health_interval_s", 3600.0)
    overrides.setdefault("wait_for_workers_s", 0.0)
    workers = tuple(parse_worker_spec(spec) for spec in worker_specs)
    settings = Settings.defaults(workers=workers, **overrides)
    async with trio.open_nursery() as nursery:
        running: RunningRouter = await nursery.start(partial(run_router, settings))
        try:
            yield running
        finally:
            nursery.cancel_scope.cancel()

"""Fake workers started in-process for tests: `async with open_fake_fleet(3) as fleet: ...`.

Each worker serves on 127.0.0.1 with a port of its own (port 0), in a nursery the context
manager owns; leaving the block stops them all. A handle gives the URL for HTTP and the
`FakeWorker` itself for direct reads of its counters and live behaviour.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from router.fake_worker.engine import FakeWorker, serve_fake_worker
from router.fake_worker.settings import FakeWorkerSettings


@dataclass(frozen=True, slots=True)
class FakeWorkerHandle:
    url: str
    port: int
    worker: FakeWorker

    @property
    def settings(self) -> FakeWorkerSettings:
        return self.worker.settings


@asynccontextmanager
async def open_fake_fleet(
    workers: int | Sequence[FakeWorkerSettings], **overrides: object
) -> AsyncIterator[list[FakeWorkerHandle]]:
    """Start `workers` fake workers (a count of default ones, or one per settings object),
    all ready before the block runs.

    `overrides` are settings fields applied to every worker (e.g. `tokens=4`); host and
    port are always 127.0.0.1:0. On exit every worker is cancelled and its sockets closed.
    """
    if isinstance(workers, int):
        settings_list: list[FakeWorkerSettings] = [FakeWorkerSettings() for _ in range(workers)]
    else:
        settings_list = list(workers)
    settings_list = [
        dataclasses.replace(s, **overrides, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        for s in settings_list
    ]
    async with trio.open_nursery() as nursery:
        handles = []
        for settings in settings_list:
            worker = FakeWorker(settings)
            url = await nursery.start(functools.partial(serve_fake_worker, settings, worker=worker))
            handles.append(FakeWorkerHandle(url=url, port=worker.port, worker=worker))
        try:
            yield handles
        finally:
            nursery.cancel_scope.cancel()

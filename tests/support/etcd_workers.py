"""Fake workers registered in etcd in-process, through the agent's own registration code,
and a router discovering them.

`register` starts `serve_registration` in a cancel scope of the caller's nursery and
returns the `Registration` with that scope: cancelling the scope stops the heartbeat
without revoking anything, which is what a crashed worker looks like to etcd.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import trio

from router.agent.advertise import worker_record
from router.agent.registration import Registration, serve_registration
from router.cli.serve import RunningRouter
from router.fleet.records import WorkerRecord
from tests.support.router_instance import open_router

PREFIX = "/test/workers/"
MODEL = "fake-model"


@dataclass(slots=True)
class Registered:
    registration: Registration
    crash_scope: trio.CancelScope

    def crash(self) -> None:
        """Stop heartbeats without revoking: the key lives until its lease expires."""
        self.crash_scope.cancel()


def record_for(worker_id: str, url: str) -> WorkerRecord:
    return worker_record(worker_id=worker_id, url=url, model=MODEL, role="mixed", engine="sglang")


async def register(
    nursery: trio.Nursery,
    etcd_url: str,
    record: WorkerRecord,
    *,
    lease_ttl_s: int,
    prefix: str = PREFIX,
) -> Registered:
    """Register `record` and return once it is in etcd (retrying while etcd is down)."""
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[Registration]) -> None:
        with scope:
            await serve_registration(
                etcd_url, prefix, record, lease_ttl_s=lease_ttl_s, task_status=task_status
            )

    registration: Registration = await nursery.start(run)
    return Registered(registration, scope)


def open_etcd_router(etcd_url: str, **overrides: Any) -> AbstractAsyncContextManager[RunningRouter]:
    """A router (settings `overrides`) discovering the workers registered under `PREFIX` in
    the etcd at `etcd_url`."""
    return open_router(discovery="etcd", etcd_endpoint=etcd_url, etcd_prefix=PREFIX, **overrides)

"""A discovery-only plane: a router that is told no worker on its command line.

It stands for a router that only follows etcd (the shape of the Infera gateway a plane
author tried): every case's fleet, static or not, reaches it as records in an etcd the
plane owns, under a prefix of its own and in a record shape of its own, written by the
`prepare` hook before the router starts and by `publish` / `withdraw` as the case
changes the fleet. The router behind it is this repository's `router serve` with
`--discovery etcd`, which reads that shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import httpx

from conformance import etcd_sidecar
from conformance.fleet import RunningWorker
from conformance.model import Case
from conformance.planes.base import Launch, Unsupported
from conformance.planes.python import PythonPlane
from conformance.sidecars import Sidecars

PREFIX = "/discovery-only/fleet/"


def own_record(worker: RunningWorker, status: str) -> dict[str, Any]:
    """The plane's record: no `engine`, and the status written out even when ACTIVE."""
    spec = worker.spec
    out: dict[str, Any] = {
        "id": spec.name,
        "url": worker.url,
        "model": [spec.model],
        "role": spec.role,
        "dp_size": spec.dp_size,
        "status": "DRAINING" if status == "draining" else "ACTIVE",
    }
    if spec.role == "prefill" and worker.bootstrap_port is not None:
        out["disagg_meta"] = {
            "protocol": "mooncake",
            "params": {"bootstrap_addr": f"127.0.0.1:{worker.bootstrap_port}"},
        }
    return out


class DiscoveryOnlyPlane(PythonPlane):
    name = "discovery-only"
    divergences: ClassVar[Path | None] = None
    capabilities = PythonPlane.capabilities - {"discovery.kubernetes"}

    async def start_sidecars(self, sidecars: Sidecars, case: Case) -> None:
        if case.discovery not in (None, "etcd"):
            raise Unsupported(f"the discovery-only plane follows etcd, not {case.discovery}")
        await etcd_sidecar.start_etcd(sidecars, prefix=PREFIX)

    async def prepare(self, launch: Launch, client: httpx.AsyncClient) -> None:
        # Static or not, the fleet exists for this router only as records.
        for worker in launch.workers:
            await self.publish(launch, client, worker, worker.spec.status)

    async def publish(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker, status: str
    ) -> None:
        await etcd_sidecar.put_record(client, launch.sidecars, worker, status, shape=own_record)

    async def withdraw(
        self, launch: Launch, client: httpx.AsyncClient, worker: RunningWorker
    ) -> None:
        await etcd_sidecar.delete_record(client, launch.sidecars, worker)

    def fleet_flags(self, launch: Launch) -> list[str]:
        values = launch.sidecars.values
        return [
            "--discovery",
            "etcd",
            "--etcd-endpoint",
            values[etcd_sidecar.URL_KEY],
            "--etcd-prefix",
            values[etcd_sidecar.PREFIX_KEY],
        ]

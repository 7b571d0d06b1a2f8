"""What the fleet's counters say about a step: dispatches per worker and PD handoffs,
read from every fake worker's `/debug/routing` once they stop moving."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import trio

from conformance.expect import WorkerView
from conformance.fleet import CaseFleet

SETTLE_INTERVAL_S = 0.05
SETTLE_ROUNDS = 20
# How many handoffs a fake worker's /debug/routing keeps.
HANDOFF_HISTORY = 100


async def settled_routing(fleet: CaseFleet, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """The fleet's routing counters once they stop moving.

    A plane may answer the client before a leg it started reached its worker (a PD
    prefill, a hedged request), so one reading right after the answers can miss it.
    """
    previous = await fleet.routing(client)
    for _ in range(SETTLE_ROUNDS):
        await trio.sleep(SETTLE_INTERVAL_S)
        current = await fleet.routing(client)
        if _dispatches(current) == _dispatches(previous):
            return current
        previous = current
    return previous


def _dispatches(routing: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    return {name: int(data.get("dispatches", 0)) for name, data in routing.items()}


def worker_view(
    start: Mapping[str, Mapping[str, Any]],
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
) -> WorkerView:
    first, low, high = _dispatches(start), _dispatches(before), _dispatches(after)
    handoffs: dict[str, list[Mapping[str, Any]]] = {}
    for name, data in after.items():
        now = list(data.get("handoffs", []))
        earlier = len(before.get(name, {}).get("handoffs", []))
        if len(now) < HANDOFF_HISTORY:
            fresh = now[earlier:]  # nothing dropped yet: the new ones follow the old
        else:
            # The list rolled over; each dispatch of the step added at most one handoff.
            new = high[name] - low.get(name, 0)
            fresh = now[len(now) - min(new, len(now)) :]
        handoffs[name] = fresh
    return WorkerView(
        delta={name: high[name] - low.get(name, 0) for name in high},
        total={name: high[name] - first.get(name, 0) for name in high},
        handoffs=handoffs,
    )

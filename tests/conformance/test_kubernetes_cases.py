"""The Kubernetes form of the discovery cases: the fake API server runs as the plane's
sidecar, fleet changes become Pod changes, and a case fails on an adapter that never
applies them. Every process the plane started (the API server among them) is gone when
the case ends, whatever its verdict.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from conformance import kube_sidecar
from conformance.fleet import open_fleet
from conformance.loader import load_case, load_cases, select_cases
from conformance.planes.python import PythonPlane
from conformance.processes import ProcessFailed
from conformance.runner import Outcome, RunOptions, run_suite
from conformance.sidecars import open_sidecars
from tests.conformance.stub_planes import MARK_VARIABLE
from tests.conformance.test_sidecars import marked

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec"
DRAINING = "discovery/kubernetes/draining-worker-finishes-in-flight"
REMOVED = "discovery/kubernetes/removed-worker-breaker-forgotten"
READDED = "discovery/kubernetes/readded-worker-starts-closed"
CACHE = "cache_aware/removed-worker-forgotten"


class Marked(PythonPlane):
    """Our plane with a mark on every process it starts (itself and its sidecars), and
    a count of them once it is ready."""

    name = "python-marked"
    divergences = None
    mark = ""
    seen_at_ready: list[int]

    def environment(self) -> Mapping[str, str]:
        return {MARK_VARIABLE: self.mark}

    async def wait_ready(self, client: httpx.AsyncClient, url: str, launch: Any) -> None:
        await super().wait_ready(client, url, launch)
        self.seen_at_ready.append(len(marked(self.mark)))


class NoDeletion(Marked):
    """Never begins a Pod's deletion: `draining` keeps the Pod Ready."""

    name = "python-no-deletion"

    async def publish(self, launch, client, worker, status):  # type: ignore[no-untyped-def]
        await super().publish(launch, client, worker, "active" if status == "draining" else status)


class NoRemoval(Marked):
    """Never deletes a Pod: a removed worker stays, with its old state, and `add` only
    makes it Ready again."""

    name = "python-no-removal"

    async def withdraw(self, launch, client, worker):  # type: ignore[no-untyped-def]
        return None


async def run_marked(
    plane: Marked, case_ids: list[str], case_timeout_s: float = 120.0, *, saw_ready: bool = True
) -> dict[str, Outcome]:
    plane.mark = "conformance-kube-" + uuid.uuid4().hex
    plane.seen_at_ready = []
    cases = select_cases(load_cases([SPEC], SPEC).cases, case_ids, [])
    assert len(cases) == len(case_ids)
    try:
        with trio.fail_after(180):
            outcomes = await run_suite(
                cases, [plane], {}, RunOptions(jobs=4, case_timeout_s=case_timeout_s)
            )
    finally:
        leftovers = marked(plane.mark)
        for pid in leftovers:  # whatever a failed run left, so the test leaves nothing
            os.kill(pid, signal.SIGKILL)
    # The plane and its API server were both up while each case ran, and nothing is now.
    if saw_ready:
        assert plane.seen_at_ready and min(plane.seen_at_ready) >= 2, plane.seen_at_ready
    assert leftovers == []
    return {outcome.case_id: outcome for outcome in outcomes}


async def test_a_case_that_passes_leaves_no_api_server_behind() -> None:
    outcomes = await run_marked(Marked(), [DRAINING])
    assert outcomes[DRAINING].verdict == "pass", outcomes


async def test_a_case_that_times_out_leaves_no_api_server_behind() -> None:
    # The plane may or may not be ready by then on a loaded machine; the API server, which
    # starts first, is up either way.
    outcomes = await run_marked(Marked(), [CACHE], case_timeout_s=6.0, saw_ready=False)
    assert outcomes[CACHE].verdict == "error"
    assert "did not finish within 6s" in outcomes[CACHE].detail


async def test_the_kubernetes_cases_fail_when_the_pod_changes_never_happen() -> None:
    """An adapter that never begins a deletion feeds the terminating worker; one that
    never deletes a Pod keeps the old worker's breaker and prefixes: each case fails, on
    its dispatch counts."""
    draining: dict[str, Outcome] = {}
    removal: dict[str, Outcome] = {}

    async def run_into(into: dict[str, Outcome], plane: Marked, case_ids: list[str]) -> None:
        into.update(await run_marked(plane, case_ids))

    async with trio.open_nursery() as nursery:  # both at once: the suite's time counts
        nursery.start_soon(run_into, draining, NoDeletion(), [DRAINING])
        nursery.start_soon(run_into, removal, NoRemoval(), [REMOVED, READDED, CACHE])
    outcomes = {**draining, **removal}
    assert {case_id: o.verdict for case_id, o in outcomes.items()} == dict.fromkeys(
        outcomes, "fail"
    ), outcomes
    assert any("dispatches[a]: expected 0" in line for line in draining[DRAINING].failures), (
        draining
    )
    # The old breaker is still open: a gets nothing once back.
    assert any(
        "dispatches[a]: expected [1, 3], got 0" in line for line in removal[REMOVED].failures
    ), removal
    # The old fault still counts: the breaker opens one request early and rejects.
    assert any("503" in line for line in removal[READDED].failures), removal
    # The old prefixes still pull the prompt back to a.
    assert any("dispatches[a]: expected 0, got 1" in line for line in removal[CACHE].failures), (
        removal
    )


async def pod_states(
    client: httpx.AsyncClient, values: Mapping[str, Any]
) -> dict[str, tuple[str, str, bool]]:
    """name -> (uid, Ready, terminating), as the API server lists the Pods."""
    response = await client.get(
        f"{values[kube_sidecar.URL_KEY]}/api/v1/namespaces/default/pods",
        params={"labelSelector": kube_sidecar.SELECTOR},
        headers={"authorization": f"Bearer {values[kube_sidecar.TOKEN_KEY]}"},
    )
    assert response.status_code == 200, response.text
    return {
        pod["metadata"]["name"]: (
            pod["metadata"]["uid"],
            pod["status"]["conditions"][0]["status"],
            "deletionTimestamp" in pod["metadata"],
        )
        for pod in response.json()["items"]
    }


async def test_fleet_changes_become_the_pod_changes_a_controller_makes() -> None:
    case = load_case(SPEC / f"{DRAINING}.yaml", SPEC)
    with tempfile.TemporaryDirectory() as scratch, trio.fail_after(60):
        async with (
            httpx.AsyncClient(trust_env=False) as client,
            open_sidecars({}, Path(scratch)) as sidecars,
        ):
            await kube_sidecar.start_fake_kube_api(sidecars)  # before the fleet, as the runner does
            async with open_fleet(case, client) as fleet:
                await check_pod_changes(client, sidecars, fleet)


async def check_pod_changes(client: httpx.AsyncClient, sidecars: Any, fleet: Any) -> None:
    a, b = fleet.workers["a"], fleet.workers["b"]
    # One port for every worker, each on an address of its own: a Pod IP each.
    assert kube_sidecar.shared_port([a, b]) > 0
    assert {a.url.split(":")[1], b.url.split(":")[1]} == {"//127.0.0.1", "//127.0.0.2"}
    await kube_sidecar.publish(client, sidecars, a, "active")
    await kube_sidecar.publish(client, sidecars, b, "not_ready")
    first = await pod_states(client, sidecars.values)
    assert {name: state[1:] for name, state in first.items()} == {
        "a": ("True", False),
        "b": ("False", False),
    }
    await kube_sidecar.publish(client, sidecars, b, "active")
    await kube_sidecar.publish(client, sidecars, a, "draining")
    assert {n: s[1:] for n, s in (await pod_states(client, sidecars.values)).items()} == {
        "a": ("True", True),
        "b": ("True", False),
    }
    with pytest.raises(ProcessFailed, match="cannot be undone"):
        await kube_sidecar.publish(client, sidecars, a, "active")
    await kube_sidecar.withdraw(client, sidecars, a)
    assert set(await pod_states(client, sidecars.values)) == {"b"}
    await kube_sidecar.publish(client, sidecars, a, "active")
    again = await pod_states(client, sidecars.values)
    # A new Pod of the same name: a new uid, Ready, not terminating.
    assert again["a"][1:] == ("True", False) and again["a"][0] != first["a"][0]

"""Both planes discovering the same Pods from the fake Kubernetes API server: the SGLang
gateway (`smg`, the Rust kube client) through a kubeconfig, and our router. Neither is
told a worker URL; both find the two Pods, route to both, and stop routing to a Pod once
its deletion starts.

smg gives every discovered Pod one port (`--service-discovery-port`), so the two fake
workers share a port on two loopback addresses (127.0.0.1 and 127.0.0.2), as two Pods
share a container port on two Pod IPs.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from router.fake_worker.engine import FakeWorker, serve_fake_worker
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_kube_api import FakeKubeApi, make_pod
from tests.support.kube_fleet import write_kubeconfig
from tests.support.ports import free_port
from tests.support.router_instance import open_router
from tests.support.smg_process import smg_command, stop_smg
from tests.support.waiting import wait_until

pytestmark = pytest.mark.smg

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
HOSTS = ("127.0.0.1", "127.0.0.2")


@asynccontextmanager
async def open_pod_workers() -> AsyncIterator[tuple[int, list[FakeWorker]]]:
    """Two fake workers on one port, one per loopback address; the port and the workers."""
    async with trio.open_nursery() as nursery:
        port = 0
        workers = []
        for host in HOSTS:
            worker = FakeWorker(FakeWorkerSettings(host=host, port=port, tokens=1))
            await nursery.start(partial(serve_fake_worker, worker.settings, worker=worker))
            port = worker.port
            workers.append(worker)
        yield port, workers
        nursery.cancel_scope.cancel()


def pod(index: int) -> dict[str, Any]:
    """Pod w-INDEX, on the loopback address HOSTS[INDEX]."""
    return make_pod(
        f"w-{index}",
        ip=HOSTS[index],
        labels={"app": "engine"},
        annotations={"trio-router/model": "fake-model"},
    )


def pods(api: FakeKubeApi) -> None:
    for index in range(len(HOSTS)):
        api.add_pod(pod(index))


@asynccontextmanager
async def open_smg_on_kubernetes(kubeconfig: Path, port: int, log_path: Path) -> AsyncIterator[str]:
    listen, metrics_port = free_port(), free_port()
    command = smg_command(
        "--service-discovery",
        "--selector",
        "app=engine",
        "--service-discovery-port",
        str(port),
        "--service-discovery-namespace",
        "default",
        port=listen,
        metrics_port=metrics_port,
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(
            command, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        yield f"http://127.0.0.1:{listen}"
    finally:
        await stop_smg(process)


async def _healthy_workers(client: httpx.AsyncClient) -> int:
    try:
        response = await client.get("/readiness")
    except httpx.TransportError:
        return -1
    return (
        int(response.json().get("healthy_workers", 0)) if response.status_code in (200, 503) else -1
    )


async def stop_routing_after_deletion(
    client: httpx.AsyncClient, api: FakeKubeApi, victim: FakeWorker
) -> float:
    """Start deleting Pod w-0 (victim) and send requests until 20 in a row miss it; the
    time from the event to the last request that reached it (0 when none did)."""
    api.begin_deletion("w-0", grace_s=15)
    started = trio.current_time()
    last_hit, misses = 0.0, 0
    while misses < 20:
        before = victim.routing.dispatches
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        if victim.routing.dispatches > before:
            last_hit, misses = trio.current_time() - started, 0
        else:
            misses += 1
        await trio.sleep(0.01)
    return last_hit


async def test_smg_and_the_router_discover_the_same_pods_from_the_fake_api(tmp_path: Path) -> None:
    api = FakeKubeApi()
    pods(api)
    with trio.fail_after(120):
        async with open_pod_workers() as (port, workers), trio.open_nursery() as nursery:
            await nursery.start(api.serve)
            kubeconfig = write_kubeconfig(tmp_path, api)
            async with open_smg_on_kubernetes(kubeconfig, port, tmp_path / "smg.log") as gateway:
                async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
                    while await _healthy_workers(client) != 2:  # noqa: ASYNC110 - smg offers no event
                        await trio.sleep(0.1)
                    for worker in workers:
                        worker.routing.reset()
                    assert [
                        (await client.post("/v1/chat/completions", json=CHAT)).status_code
                        for _ in range(4)
                    ] == [200] * 4
                    smg_spread = [w.routing.dispatches for w in workers]
                    smg_last_hit = await stop_routing_after_deletion(client, api, workers[0])
            smg_requests = list(api.requests)

            # The same Pods, fresh, for our router.
            api.finish_deletion("w-0")
            api.add_pod(pod(0))
            for worker in workers:
                worker.routing.reset()
            async with (
                open_router(
                    discovery="kubernetes",
                    k8s_kubeconfig=str(kubeconfig),
                    k8s_selector="app=engine",
                    k8s_port=port,
                ) as router,
                httpx.AsyncClient(base_url=router.url, timeout=10) as client,
            ):
                await wait_until(lambda: len(router.fleet) == 2)
                assert [
                    (await client.post("/v1/chat/completions", json=CHAT)).status_code
                    for _ in range(4)
                ] == [200] * 4
                router_spread = [w.routing.dispatches for w in workers]
                router_last_hit = await stop_routing_after_deletion(client, api, workers[0])
            nursery.cancel_scope.cancel()
    print(
        f"\nlast request to a terminating Pod after its deletionTimestamp: smg {smg_last_hit * 1000:.0f} ms, router {router_last_hit * 1000:.0f} ms"
    )
    # smg found the Pods through the API server alone: it listed and watched them.
    assert any(
        "watch=" in target and "allowWatchBookmarks=true" in target for _, target in smg_requests
    )
    assert smg_spread == [2, 2] and router_spread == [2, 2]
    # Both stop sending new requests to a terminating Pod; ours at the event itself.
    assert router_last_hit < 1.0
    assert smg_last_hit < 30.0

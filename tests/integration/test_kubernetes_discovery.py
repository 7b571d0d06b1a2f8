"""The router following Pods on a fake Kubernetes API server, with fake workers standing
in for the Pods: Ready, graceful deletion with a stream in flight, 410 relists, the API
server going away, PD pools from two selectors, a rotated token, the engine's kind learned
unless annotated.

Timings printed here ("... within N ms") are functional bounds on event handling; the
asserted bounds are loose so a loaded 2-core machine passes; the medians over 20 runs are
measured by `python -m bench.kubernetes_discovery` and written in docs/kubernetes.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from router.cli.serve import RunningRouter
from router.discovery.kube_pods import ENGINE_ANNOTATION
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from router.fleet.records import Status
from tests.support.cli_process import sse_text
from tests.support.fake_fleet import open_fake_fleet
from tests.support.fake_kube_api import FakeKubeApi
from tests.support.kube_fleet import worker_pod, write_kubeconfig
from tests.support.router_instance import open_router
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

# When the API server closes a connection while httpx is writing a request, httpcore
# stops iterating the request's body (httpx's own one-chunk `ByteStream` generator, empty
# for a GET) and trio's garbage collector later reports that generator unfinished. The
# router's watch sees the broken request and resumes; nothing of ours is left open.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object ByteStream.__aiter__:pytest.PytestUnraisableExceptionWarning"
)

APP = {"app": "engine"}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# Two pools, no mixed one: Pods labelled pool=prefill and pool=decode.
PD_SELECTORS = {
    "k8s_selector": "",
    "k8s_prefill_selector": "pool=prefill",
    "k8s_decode_selector": "pool=decode",
}
EVENT_BOUND_S = 2.0  # functional bound under load; the measured figures are ~10 ms


@asynccontextmanager
async def open_kube(
    tmp_path: Path, api: FakeKubeApi, **overrides: Any
) -> AsyncIterator[RunningRouter]:
    """The fake API server, and a router discovering Pods from it through a kubeconfig."""
    async with trio.open_nursery() as nursery:
        await nursery.start(api.serve)
        overrides.setdefault("k8s_selector", "app=engine")
        async with open_router(
            discovery="kubernetes", k8s_kubeconfig=str(write_kubeconfig(tmp_path, api)), **overrides
        ) as router:
            yield router
        nursery.cancel_scope.cancel()


def pod_id(name: str) -> str:
    return f"default/{name}"


async def chat(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    return response.headers["x-router-worker"]


def metric(router: RunningRouter, name: str, labels: dict[str, str] | None = None) -> float | None:
    return router.metrics.registry.get_sample_value(name, labels or {})


async def test_a_pod_that_becomes_ready_is_routed_to_at_once(tmp_path: Path) -> None:
    api = FakeKubeApi()
    with trio.fail_after(30):
        async with open_fake_fleet(2) as (w0, w1):
            api.add_pod(worker_pod(w0, "w-0", APP))
            api.add_pod(worker_pod(w1, "w-1", APP, ready=False))
            async with (
                open_kube(tmp_path, api) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                assert [w.id for w in router.fleet.workers()] == [
                    pod_id("w-0")
                ]  # not Ready: no candidate
                assert router.app.discovery.up and router.app.discovery.source == "kubernetes"
                assert [await chat(client) for _ in range(3)] == [pod_id("w-0")] * 3

                api.set_ready("w-1", True)
                ready_at = trio.current_time()
                served = await chat(client)
                while served != pod_id("w-1"):
                    served = await chat(client)
                routed_after = trio.current_time() - ready_at
                print(f"\nReady -> first request routed to it: {routed_after * 1000:.1f} ms")
                assert routed_after < EVENT_BOUND_S
                assert (
                    w1.worker.routing.paths.get("/get_server_info") is None
                )  # annotated: nothing to ask
                assert (
                    metric(router, "router_discovery_up"),
                    metric(router, "router_discovery_relists_total"),
                ) == (1.0, 1.0)


async def test_a_deleted_pod_drains_its_stream_and_takes_no_new_request(tmp_path: Path) -> None:
    api = FakeKubeApi()
    slow = FakeWorkerSettings(tokens=40, token_latency_ms=25)  # a stream of about a second
    with trio.fail_after(60):
        async with open_fake_fleet([slow, slow]) as (w0, w1):
            api.add_pod(worker_pod(w0, "w-0", APP))
            api.add_pod(worker_pod(w1, "w-1", APP))
            async with (
                open_kube(tmp_path, api) as router,
                httpx.AsyncClient(base_url=router.url, timeout=30) as client,
            ):
                stream_body = {**CHAT, "stream": True, "max_tokens": 40}
                async with client.stream(
                    "POST", "/v1/chat/completions", json=stream_body
                ) as stream:
                    assert stream.status_code == 200
                    victim = stream.headers["x-router-worker"]
                    handle = w0 if victim == pod_id("w-0") else w1
                    chunks = stream.aiter_raw()
                    received = [await anext(chunks)]
                    answers: list[tuple[int, str | None, bool]] = []
                    dispatches_at_start = handle.worker.routing.dispatches

                    async def traffic() -> None:
                        # 30 short requests sent across the deletion, 5 at a time.
                        async def one() -> None:
                            # Whether the router had seen the drain when this request was
                            # sent: one sent before may still be answered by the victim.
                            sent_after_drain = draining()
                            response = await client.post(
                                "/v1/chat/completions", json={**CHAT, "max_tokens": 1}
                            )
                            answers.append(
                                (
                                    response.status_code,
                                    response.headers.get("x-router-worker"),
                                    sent_after_drain,
                                )
                            )

                        for _ in range(6):
                            async with trio.open_nursery() as batch:
                                for _ in range(5):
                                    batch.start_soon(one)

                    def draining() -> bool:
                        worker = router.fleet.get(victim)
                        return worker is None or worker.draining

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(traffic)
                        await wait_until(lambda: len(answers) >= 10)
                        dispatches_before = handle.worker.routing.dispatches
                        api.begin_deletion(victim.split("/")[1], grace_s=15)
                        deleted_at = trio.current_time()
                        await wait_until(draining)
                        out_after = trio.current_time() - deleted_at
                        print(f"\ndeletionTimestamp -> out of routing: {out_after * 1000:.1f} ms")
                        assert out_after < EVENT_BOUND_S
                        dispatches_at_drain = handle.worker.routing.dispatches
                    received += [chunk async for chunk in chunks]
                text, done = sse_text(b"".join(received))
                assert done and "event: error" not in b"".join(received).decode()
                assert text == expected_text(40)  # every token, none cut off
                worker = router.fleet.get(victim)
                assert (
                    worker is not None and worker.record.status is Status.DRAINING
                )  # until DELETED
                assert router.fleet.pending == {}
                api.finish_deletion(victim.split("/")[1])
                await wait_until(lambda: router.fleet.get(victim) is None)
            assert [status for status, _, _ in answers] == [200] * 30
            # Not one request sent after the drain was seen reached the victim.
            assert all(
                served != victim for _, served, sent_after_drain in answers if sent_after_drain
            )
            # Every dispatch the victim counted is a request it answered (a request picked
            # before the drain may reach it after `dispatches_at_drain` was read)...
            victim_answers = sum(1 for _, served, _ in answers if served == victim)
            assert handle.worker.routing.dispatches - dispatches_at_start == victim_answers
            # ...and after the deletion, at most the batch already in flight.
            assert handle.worker.routing.dispatches - dispatches_before <= 5
            assert dispatches_at_drain <= handle.worker.routing.dispatches


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_a_410_relists_and_no_request_fails(tmp_path: Path, gone_as_http: bool) -> None:
    api = FakeKubeApi(gone_as_http=gone_as_http)
    with trio.fail_after(30):
        async with open_fake_fleet(3) as (w0, w1, w2):
            api.add_pod(worker_pod(w0, "w-0", APP))
            api.add_pod(worker_pod(w1, "w-1", APP))
            async with (
                open_kube(tmp_path, api) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                traffic = Traffic()
                stop = trio.Event()
                send = partial(client.post, "/v1/chat/completions", json=CHAT)
                async with trio.open_nursery() as spare, trio.open_nursery() as nursery:
                    # A run sends about 35 across the relist; the bound only stops a runaway.
                    nursery.start_soon(partial(traffic.keep_sending, send, stop=stop, most=2000))
                    await wait_until(lambda: len(traffic.answers) >= 5)
                    # The watch is cut, then everything it could resume from is compacted
                    # away, and meanwhile w-1 went and w-2 came.
                    await wait_until(lambda: api.watches_open == 1)
                    api.go_away()
                    api.finish_deletion("w-1")
                    api.add_pod(worker_pod(w2, "w-2", APP))
                    api.compact()
                    await spare.start(api.serve)
                    await wait_until(lambda: router.fleet.get(pod_id("w-2")) is not None)
                    count = len(traffic.answers)
                    await wait_until(lambda: len(traffic.answers) >= count + 5)
                    stop.set()
                    assert sorted(w.id for w in router.fleet.workers()) == [
                        pod_id("w-0"),
                        pod_id("w-2"),
                    ]
                    assert metric(router, "router_discovery_relists_total") == 2.0
                    assert router.app.discovery.up
                    spare.cancel_scope.cancel()
                assert traffic.statuses() == [200] * len(traffic.answers)


async def test_the_api_server_going_away_keeps_the_fleet_and_loses_no_request(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()
    with trio.fail_after(60):
        async with open_fake_fleet(3) as (w0, w1, w2), trio.open_nursery() as spare:
            api.add_pod(worker_pod(w0, "w-0", APP))
            api.add_pod(worker_pod(w1, "w-1", APP))
            async with (
                open_kube(tmp_path, api) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                await wait_until(lambda: api.watches_open == 1)
                api.go_away()
                await wait_until(lambda: not router.app.discovery.up)
                health = (await client.get("/health")).json()
                assert health["discovery"]["up"] is False
                assert "unreachable" in health["discovery"]["detail"]
                assert metric(router, "router_discovery_up") == 0.0
                # Meanwhile: the last fleet serves every request.
                served = [await chat(client) for _ in range(10)]
                assert sorted(set(served)) == [pod_id("w-0"), pod_id("w-1")]
                api.add_pod(worker_pod(w2, "w-2", APP))  # a change the router cannot see yet
                await spare.start(api.serve)  # back on the same port
                await wait_until(lambda: router.fleet.get(pod_id("w-2")) is not None)
                assert router.app.discovery.up and metric(router, "router_discovery_up") == 1.0
                assert sorted(set([await chat(client) for _ in range(6)])) == [
                    pod_id(f"w-{i}") for i in range(3)
                ]
                # it resumed from its version: no relist was needed
                assert metric(router, "router_discovery_relists_total") == 1.0
            spare.cancel_scope.cancel()


async def test_pd_pools_from_two_selectors_with_the_bootstrap_port_from_the_annotation(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()
    settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9300),
        FakeWorkerSettings(role="decode"),
    ]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (prefill, decode):
            # The annotation says 9400: an explicit value wins over what the engine states.
            api.add_pod(
                worker_pod(
                    prefill, "p-0", {"pool": "prefill"}, **{"sglang.ai/bootstrap-port": "9400"}
                )
            )
            api.add_pod(worker_pod(decode, "d-0", {"pool": "decode"}))
            async with (
                open_kube(tmp_path, api, **PD_SELECTORS) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                roles = {w.id: w.role.value for w in router.fleet.workers()}
                assert roles == {pod_id("p-0"): "prefill", pod_id("d-0"): "decode"}
                assert [await chat(client) for _ in range(3)] == [pod_id("d-0")] * 3
            assert [h["bootstrap_port"] for h in decode.worker.routing.handoffs] == [9400] * 3
            assert prefill.worker.routing.paths.get("/get_server_info") is None
            assert prefill.worker.routing.dispatches == 3


async def test_pd_pools_learn_the_bootstrap_port_and_facts_from_the_engine(tmp_path: Path) -> None:
    api = FakeKubeApi()
    settings = [
        FakeWorkerSettings(role="prefill", bootstrap_port=9301, dp_size=2),
        FakeWorkerSettings(role="decode"),
    ]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (prefill, decode):
            api.add_pod(worker_pod(prefill, "p-0", {"pool": "prefill"}, facts_in_annotations=False))
            api.add_pod(worker_pod(decode, "d-0", {"pool": "decode"}, facts_in_annotations=False))
            async with (
                open_kube(tmp_path, api, **PD_SELECTORS) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                await wait_until(lambda: len(router.fleet) == 2)
                worker = router.fleet.get(pod_id("p-0"))
                assert (
                    worker is not None
                    and worker.record.dp_size == 2
                    and worker.record.models == ("fake-model",)
                )
                for _ in range(4):
                    await chat(client)
            assert [h["bootstrap_port"] for h in decode.worker.routing.handoffs] == [9301] * 4
            assert prefill.worker.routing.ranks == {"0": 2, "1": 2}
            assert prefill.worker.routing.paths.get("/get_server_info") == 1


async def test_a_rotated_token_file_is_read_again(tmp_path: Path) -> None:
    api = FakeKubeApi(token="first")
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    with trio.fail_after(30):
        async with open_fake_fleet(2) as (w0, w1), trio.open_nursery() as nursery:
            api.add_pod(worker_pod(w0, "w-0", APP))
            await nursery.start(api.serve)
            kubeconfig = write_kubeconfig(tmp_path, api, token_file=token_file)
            async with open_router(
                discovery="kubernetes", k8s_kubeconfig=str(kubeconfig), k8s_selector="app=engine"
            ) as router:
                await wait_until(lambda: api.watches_open == 1)
                token_file.write_text("second-and-longer\n")
                api.token = "second-and-longer"
                api.end_watches()  # the next watch request carries the new token
                api.add_pod(worker_pod(w1, "w-1", APP))
                await wait_until(lambda: router.fleet.get(pod_id("w-1")) is not None)
                assert router.app.discovery.up
            assert api.unauthorized == 0
            assert (
                sum(1 for method, _ in api.requests if method == "GET") >= 3
            )  # list, watch, watch
            nursery.cancel_scope.cancel()


async def test_a_pod_without_the_engine_annotation_learns_the_kind_and_the_annotation_wins(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()
    settings = [FakeWorkerSettings(engine="vllm"), FakeWorkerSettings(engine="sglang")]
    with trio.fail_after(30):
        async with open_fake_fleet(settings) as (vllm, sglang):
            # Model and DP size annotated; the engine's kind left to its answers.
            learned = worker_pod(vllm, "v-0", APP)
            del learned["metadata"]["annotations"][ENGINE_ANNOTATION]
            api.add_pod(learned)
            # Annotated (wrongly, even): the annotation wins and the kind is not asked.
            api.add_pod(worker_pod(sglang, "s-0", APP, **{ENGINE_ANNOTATION: "vllm"}))
            async with (
                open_kube(tmp_path, api) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                await wait_until(lambda: len(router.fleet) == 2 and not router.fleet.describing)
                listing = (await client.get("/v1/workers")).json()["workers"]
                served = {await chat(client) for _ in range(4)}
    engines = {entry["id"]: entry["engine"] for entry in listing}
    assert engines == {pod_id("v-0"): "vllm", pod_id("s-0"): "vllm"}
    assert served == {pod_id("v-0"), pod_id("s-0")}
    assert vllm.worker.routing.paths.get("/version") == 1
    assert "/get_server_info" not in sglang.worker.routing.paths

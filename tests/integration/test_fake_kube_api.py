"""The fake Kubernetes API server is faithful enough for the official `kubernetes` client:
it lists, watches and sees every event kind (ADDED, MODIFIED, DELETED, BOOKMARK, and an
ERROR carrying 410) without a client-side error. The client is synchronous, so it runs
in a thread while the fake serves on trio."""

from __future__ import annotations

from typing import Any

import httpx
import kubernetes
import pytest
import trio

from tests.support.fake_kube_api import FakeKubeApi, make_pod
from tests.support.waiting import wait_until


def core_api(api: FakeKubeApi, token: str | None = None) -> kubernetes.client.CoreV1Api:
    configuration = kubernetes.client.Configuration()
    configuration.host = api.url
    configuration.api_key = {"authorization": token or api.token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))


def watch_events(
    core: kubernetes.client.CoreV1Api, count: int, **kwargs: Any
) -> list[tuple[str, Any]]:
    """The first `count` events of a watch through the client's own `Watch` helper."""
    seen: list[tuple[str, Any]] = []
    watcher = kubernetes.watch.Watch()
    for event in watcher.stream(core.list_namespaced_pod, "default", **kwargs):
        seen.append((event["type"], event["object"]))
        if len(seen) == count:
            watcher.stop()
    return seen


async def test_the_official_client_lists_and_watches_every_event_kind() -> None:
    api = FakeKubeApi()
    api.add_pod(make_pod("w-0", labels={"app": "engine"}))
    api.add_pod(make_pod("other", labels={"app": "db"}))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(api.serve)
            core = core_api(api)
            listing = await trio.to_thread.run_sync(
                lambda: core.list_namespaced_pod("default", label_selector="app=engine")
            )
            assert [pod.metadata.name for pod in listing.items] == ["w-0"]
            assert listing.items[0].status.conditions[0].type == "Ready"
            version = listing.metadata.resource_version

            async def changes() -> None:
                await wait_until(lambda: api.watches_open == 1)
                api.add_pod(make_pod("w-1", labels={"app": "engine"}))
                api.set_ready("w-1", False)
                api.bookmark()
                api.begin_deletion("w-1", grace_s=15)
                api.finish_deletion("w-1")

            nursery.start_soon(changes)
            events = await trio.to_thread.run_sync(
                lambda: watch_events(
                    core,
                    5,
                    label_selector="app=engine",
                    resource_version=version,
                    allow_watch_bookmarks=True,
                )
            )
            kinds = [kind for kind, _ in events]
            # A bookmark comes after the changes already made when it was asked for.
            assert sorted(kinds) == ["ADDED", "BOOKMARK", "DELETED", "MODIFIED", "MODIFIED"]
            changes_seen = [(kind, obj) for kind, obj in events if kind != "BOOKMARK"]
            assert [kind for kind, _ in changes_seen] == [
                "ADDED",
                "MODIFIED",
                "MODIFIED",
                "DELETED",
            ]
            added = changes_seen[0][1]
            assert isinstance(added, kubernetes.client.V1Pod) and added.metadata.name == "w-1"
            terminating = changes_seen[2][1]
            assert terminating.metadata.deletion_timestamp is not None
            assert terminating.status.phase == "Running"  # a terminating Pod is still Running
            versions = [
                int(obj["metadata"]["resourceVersion"])
                if kind == "BOOKMARK"
                else int(obj.metadata.resource_version)
                for kind, obj in events
            ]
            assert versions == sorted(versions) and int(version) < versions[0]
            nursery.cancel_scope.cancel()


async def test_a_compacted_version_is_a_410_the_official_client_reports() -> None:
    api = FakeKubeApi()
    api.add_pod(make_pod("w-0"))
    api.add_pod(make_pod("w-1"))
    api.compact()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(api.serve)
            core = core_api(api)

            def watch_old() -> Exception | None:
                watcher = kubernetes.watch.Watch()
                try:
                    # timeout_seconds turns off the helper's one silent retry after a 410.
                    for _ in watcher.stream(
                        core.list_namespaced_pod,
                        "default",
                        resource_version="101",
                        timeout_seconds=5,
                    ):
                        pass
                except kubernetes.client.exceptions.ApiException as exc:
                    return exc
                return None

            error = await trio.to_thread.run_sync(watch_old)
            assert isinstance(error, kubernetes.client.exceptions.ApiException)
            assert error.status == 410
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_no_or_a_wrong_token_is_401_and_changes_nothing(token: str | None) -> None:
    api = FakeKubeApi()
    api.add_pod(make_pod("w-0"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(api.serve)
            headers = {} if token is None else {"authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=api.url) as http:
                listed = await http.get("/api/v1/namespaces/default/pods", headers=headers)
                deleted = await http.delete("/api/v1/namespaces/default/pods/w-0", headers=headers)
            assert (listed.status_code, deleted.status_code) == (401, 401)
            assert listed.json()["kind"] == "Status" and listed.json()["code"] == 401
            assert "deletionTimestamp" not in api.pods[("default", "w-0")]["metadata"]
            nursery.cancel_scope.cancel()


async def test_graceful_deletion_through_the_official_client() -> None:
    api = FakeKubeApi()
    api.add_pod(make_pod("w-0"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(api.serve)
            core = core_api(api)
            version = api.version
            await trio.to_thread.run_sync(
                lambda: core.delete_namespaced_pod("w-0", "default", grace_period_seconds=1)
            )
            pod = api.pods[("default", "w-0")]
            assert pod["metadata"]["deletionTimestamp"] and pod["status"]["phase"] == "Running"
            events = await trio.to_thread.run_sync(
                lambda: watch_events(core, 2, resource_version=str(version))
            )
            assert [kind for kind, _ in events] == ["MODIFIED", "DELETED"]
            assert ("default", "w-0") not in api.pods
            nursery.cancel_scope.cancel()

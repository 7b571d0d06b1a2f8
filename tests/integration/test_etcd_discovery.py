"""The router following a real etcd: discovery, lease expiry, DRAINING, compaction,
outages and malformed records. Workers register through the agent's registration code."""

from __future__ import annotations

import logging
from functools import partial

import httpx
import pytest
import trio

from router.cli.serve import RunningRouter
from router.discovery.etcd_client import open_etcd_client
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import (
    MODEL,
    PREFIX,
    open_etcd_router,
    record_for,
    register,
)
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def send(router: RunningRouter, count: int) -> list[str]:
    """`count` sequential chat requests through the router; the worker id of each (all 200)."""
    served = []
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        for _ in range(count):
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text
            served.append(response.headers["x-router-worker"])
    return served


def dispatches(fleet: list[FakeWorkerHandle]) -> list[int]:
    return [w.worker.routing.dispatches for w in fleet]


def metric(router: RunningRouter, name: str, labels: dict[str, str] | None = None) -> float:
    return router.metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def keys(etcd_url: str) -> list[str]:
    async with open_etcd_client(etcd_url) as client:
        return [kv.key for kv in (await client.get_prefix(PREFIX)).kvs]


async def test_three_workers_are_discovered_and_one_that_crashes_leaves_after_its_ttl(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(3, tokens=2) as fleet, trio.open_nursery() as nursery:
            workers = [
                await register(nursery, etcd.url, record_for(f"w{i}", w.url), lease_ttl_s=2)
                for i, w in enumerate(fleet[:2])
            ]
            async with open_etcd_router(etcd.url) as router:
                assert sorted(w.id for w in router.fleet.workers()) == ["w0", "w1"]  # listed
                workers.append(
                    await register(nursery, etcd.url, record_for("w2", fleet[2].url), lease_ttl_s=2)
                )
                await wait_until(lambda: router.fleet.get("w2") is not None)  # watched
                assert router.app.discovery.up and router.app.discovery.source == "etcd"

                assert sorted(await send(router, 30)) == ["w0"] * 10 + ["w1"] * 10 + ["w2"] * 10
                assert dispatches(fleet) == [10, 10, 10]

                workers[2].crash()
                crashed_at = trio.current_time()
                await wait_until(lambda: router.fleet.get("w2") is None)
                gone_after_s = trio.current_time() - crashed_at
                print(f"\nheartbeats stopped -> worker dropped (TTL 2 s): {gone_after_s:.2f} s")
                # etcd's minimum TTL is 2 s and it checks expiry every 0.5 s: not before
                # the lease can have run out, and by its expiry, not never (the upper
                # bound leaves room for a loaded machine: the run is bounded at 30 s).
                assert 0.5 < gone_after_s < 15.0
                assert await keys(etcd.url) == [PREFIX + "w0", PREFIX + "w1"]

                assert sorted(await send(router, 10)) == ["w0"] * 5 + ["w1"] * 5
                assert dispatches(fleet) == [15, 15, 10]
                assert metric(router, "router_discovery_events_total", {"type": "put"}) == 1
                assert metric(router, "router_discovery_events_total", {"type": "delete"}) == 1
                assert metric(router, "router_discovery_relists_total") == 0
                # The survivors' heartbeats kept their keys alive across several TTLs.
                assert workers[0].registration.statistics().heartbeats >= 3
            nursery.cancel_scope.cancel()


async def test_a_draining_worker_gets_no_new_work_but_stays_listed_until_it_leaves(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(3, tokens=2) as fleet, trio.open_nursery() as nursery:
            workers = [
                await register(nursery, etcd.url, record_for(f"w{i}", w.url), lease_ttl_s=30)
                for i, w in enumerate(fleet)
            ]
            async with (
                open_etcd_router(etcd.url) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                assert sorted(await send(router, 6)) == ["w0", "w0", "w1", "w1", "w2", "w2"]

                assert await workers[1].registration.announce_draining()
                await wait_until(lambda: router.fleet.get("w1").draining)  # type: ignore[union-attr]
                assert sorted(await send(router, 10)) == ["w0"] * 5 + ["w2"] * 5
                assert dispatches(fleet) == [7, 2, 7]

                listing = (await client.get("/v1/workers")).json()["workers"]
                assert {w["id"]: w["status"] for w in listing} == {
                    "w0": "ACTIVE",
                    "w1": "DRAINING",
                    "w2": "ACTIVE",
                }
                health = (await client.get("/health")).json()
                assert (health["workers"], health["available"], health["draining"]) == (3, 2, 1)

                # Deregistration removes it, not the 30 s TTL: the bound is a third of the
                # TTL, loose enough for a loaded machine and still far from the expiry.
                left_at = trio.current_time()
                assert await workers[1].registration.deregister()
                await wait_until(lambda: router.fleet.get("w1") is None)
                assert trio.current_time() - left_at < 10.0
                assert await keys(etcd.url) == [PREFIX + "w0", PREFIX + "w2"]
                stats = workers[1].registration.statistics()
                assert (stats.grants, stats.writes, stats.lease_id) == (1, 2, None)
            nursery.cancel_scope.cancel()


class TcpProxy:
    """Forwards loopback TCP to a port until `block()`: then every connection is cut and
    the port refuses new ones until `unblock()`, as when the network to etcd fails."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._accepting = trio.CancelScope()
        self._unblocked = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int]) -> None:
        port = 0
        while True:
            listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
            if port == 0:
                port = listeners[0].socket.getsockname()[1]
                task_status.started(port)
            with self._accepting:
                await trio.serve_listeners(self._forward, listeners)
            for listener in listeners:
                await listener.aclose()
            await self._unblocked.wait()
            self._accepting = trio.CancelScope()

    def block(self) -> None:
        self._unblocked = trio.Event()
        self._accepting.cancel()

    def unblock(self) -> None:
        self._unblocked.set()

    async def _forward(self, client: trio.SocketStream) -> None:
        async with client:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            async with upstream, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)

    @staticmethod
    async def _pump(
        source: trio.SocketStream, sink: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        try:
            async for chunk in source:
                await sink.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # one side went away: the connection is over either way
        done.cancel()


async def test_compaction_past_the_watch_revision_relists_to_the_right_fleet(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(4, tokens=2) as fleet, trio.open_nursery() as nursery:
            proxy = TcpProxy(etcd.client_port)
            proxy_port = await nursery.start(proxy.serve)
            workers = [
                await register(nursery, etcd.url, record_for(f"w{i}", w.url), lease_ttl_s=30)
                for i, w in enumerate(fleet[:3])
            ]
            async with open_etcd_router(f"http://127.0.0.1:{proxy_port}") as router:
                assert len(router.fleet) == 3
                proxy.block()
                await wait_until(lambda: not router.app.discovery.up)

                # While the router is cut off: w1 leaves, w3 joins, w0 starts draining,
                # and etcd forgets the history the router would resume from.
                assert await workers[1].registration.deregister()
                await register(nursery, etcd.url, record_for("w3", fleet[3].url), lease_ttl_s=30)
                assert await workers[0].registration.announce_draining()
                async with open_etcd_client(etcd.url) as client:
                    for i in range(20):
                        await client.put(f"/elsewhere/{i}", b"unrelated history")
                    head = (await client.get_prefix(PREFIX)).revision
                await etcd.compact(head)
                assert sorted(w.id for w in router.fleet.workers()) == ["w0", "w1", "w2"]
                # Still routing to the fleet it knew, w1 included.
                assert sorted(await send(router, 3)) == ["w0", "w1", "w2"]

                proxy.unblock()
                await wait_until(
                    lambda: sorted(w.id for w in router.fleet.workers()) == ["w0", "w2", "w3"]
                )
                assert router.app.discovery.up
                assert router.fleet.get("w0").draining  # type: ignore[union-attr]
                assert metric(router, "router_discovery_up") == 1
                before = dispatches(fleet)
                assert sorted(await send(router, 4)) == ["w2", "w2", "w3", "w3"]
                assert [a - b for a, b in zip(dispatches(fleet), before, strict=True)] == [
                    0,
                    0,
                    2,
                    2,
                ]
                assert metric(router, "router_discovery_relists_total") == 1
            nursery.cancel_scope.cancel()


async def test_etcd_outage_keeps_the_known_fleet_and_a_worker_registered_meanwhile_appears(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(40):
        async with open_fake_fleet(4, tokens=2) as fleet, trio.open_nursery() as nursery:
            for i, w in enumerate(fleet[:3]):
                await register(nursery, etcd.url, record_for(f"w{i}", w.url), lease_ttl_s=3)
            async with (
                open_etcd_router(etcd.url) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                stopping = trio.current_time()
                await etcd.stop()
                await wait_until(lambda: not router.app.discovery.up)
                print(
                    f"\netcd stop -> router says discovery down: {trio.current_time() - stopping:.2f} s"
                )
                health = (await client.get("/health")).json()
                assert health["discovery"]["up"] is False
                assert "unreachable" in health["discovery"]["detail"]
                assert health["workers"] == 3
                assert b"router_discovery_up 0.0" in (await client.get("/metrics")).content

                assert sorted(await send(router, 9)) == ["w0"] * 3 + ["w1"] * 3 + ["w2"] * 3

                # w3 starts registering while etcd is down; it retries until etcd is back.
                nursery.start_soon(
                    partial(
                        register, nursery, etcd.url, record_for("w3", fleet[3].url), lease_ttl_s=3
                    )
                )
                assert router.fleet.get("w3") is None
                await etcd.start()
                ready = trio.current_time()
                await wait_until(lambda: router.fleet.get("w3") is not None)
                await wait_until(lambda: router.app.discovery.up)
                print(f"etcd ready -> late worker routed to: {trio.current_time() - ready:.2f} s")
                assert sorted(w.id for w in router.fleet.workers()) == ["w0", "w1", "w2", "w3"]
                assert (await client.get("/health")).json()["discovery"]["up"] is True
                assert metric(router, "router_discovery_up") == 1
                # Resumed from the last revision it saw: nothing was compacted, no relist.
                assert metric(router, "router_discovery_relists_total") == 0
                assert sorted(await send(router, 8)) == sorted(["w0", "w1", "w2", "w3"] * 2)
                assert dispatches(fleet) == [5, 5, 5, 2]
            nursery.cancel_scope.cancel()


async def test_etcd_unreachable_at_start_serves_an_empty_fleet_until_etcd_answers(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(30):
        await etcd.stop()
        async with open_fake_fleet(1, tokens=2) as fleet, trio.open_nursery() as nursery:
            async with (
                open_etcd_router(etcd.url) as router,
                httpx.AsyncClient(base_url=router.url) as client,
            ):
                assert len(router.fleet) == 0
                health = (await client.get("/health")).json()
                assert health["discovery"]["up"] is False and health["workers"] == 0
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 404

                await etcd.start()
                await register(nursery, etcd.url, record_for("w0", fleet[0].url), lease_ttl_s=30)
                await wait_until(lambda: router.fleet.get("w0") is not None)
                await wait_until(lambda: router.app.discovery.up)
                assert await send(router, 2) == ["w0", "w0"]
                assert metric(router, "router_discovery_relists_total") == 0
            nursery.cancel_scope.cancel()


async def test_malformed_records_are_logged_and_skipped(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.discovery.etcd")
    with trio.fail_after(30):
        async with open_fake_fleet(2, tokens=2) as fleet, trio.open_nursery() as nursery:
            async with open_etcd_client(etcd.url) as writer:
                await writer.put(PREFIX + "junk", b"{not json")
                await writer.put(PREFIX + "no-url", b'{"id": "x", "model": "m"}')
                await register(nursery, etcd.url, record_for("w0", fleet[0].url), lease_ttl_s=30)
                async with open_etcd_router(etcd.url) as router:
                    assert [w.id for w in router.fleet.workers()] == ["w0"]
                    await writer.put(PREFIX + "junk2", b"[1, 2]")
                    await register(
                        nursery, etcd.url, record_for("w1", fleet[1].url), lease_ttl_s=30
                    )
                    await wait_until(lambda: router.fleet.get("w1") is not None)
                    assert sorted(await send(router, 4)) == ["w0", "w0", "w1", "w1"]

                    # Garbage over a valid record: that worker leaves, as a relist would.
                    await writer.put(PREFIX + "w1", b"\xff\xfe")
                    await wait_until(lambda: router.fleet.get("w1") is None)
                    assert await send(router, 2) == ["w0", "w0"]
                    assert router.app.discovery.up
                    events = metric(router, "router_discovery_events_total", {"type": "put"})
                    assert events == 3
            nursery.cancel_scope.cancel()
    skipped = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert [m.split(":")[0] for m in skipped] == [
        f"skipping the malformed worker record at {PREFIX}{key}"
        for key in ("junk", "no-url", "junk2", "w1")
    ]

"""A worker's registration against a real etcd: lease loss, DRAINING, the drain sequence."""

from __future__ import annotations

import orjson
import pytest
import trio

from router.agent.drain import DrainResult, DrainSettings
from router.agent.registration import Registration, drain_and_deregister, serve_registration
from router.discovery.etcd_client import EtcdClient, open_etcd_client
from router.engines.metrics import EngineLoad
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import PREFIX, record_for
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
URL = "http://10.0.0.7:30000"


async def stored(client: EtcdClient, key: str) -> tuple[dict[str, object], int] | None:
    """The JSON at `key` and its lease, or None when the key is absent."""
    kvs = [kv for kv in (await client.get_prefix(key)).kvs if kv.key == key]
    return (orjson.loads(kvs[0].value), kvs[0].lease) if kvs else None


async def test_a_lost_lease_is_noticed_by_the_heartbeat_and_the_worker_registers_again(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(20):
        async with open_etcd_client(etcd.url) as client, trio.open_nursery() as nursery:
            registration: Registration = await nursery.start(
                lambda task_status: serve_registration(
                    etcd.url, PREFIX, record_for("w0", URL), lease_ttl_s=3, task_status=task_status
                )
            )
            key = PREFIX + "w0"
            first = await stored(client, key)
            assert first is not None and first[1] == registration.lease_id
            assert "status" not in first[0] and first[0]["url"] == URL

            await client.revoke_lease(first[1])  # as if it expired while etcd was out of reach
            assert await stored(client, key) is None
            lost_at = trio.current_time()
            await wait_until(lambda: registration.statistics().writes == 2, interval_s=0.02)
            again = await stored(client, key)
            # The heartbeat (every TTL/3 = 1 s) noticed and wrote the record again.
            assert trio.current_time() - lost_at < 1.5
            assert again is not None and again[0] == first[0]
            assert again[1] == registration.lease_id != first[1]
            stats = registration.statistics()
            assert (stats.grants, stats.writes, stats.lease_losses) == (2, 2, 1)
            assert await registration.deregister()
            assert await stored(client, key) is None
            # serve_registration returned by itself: the nursery closes with nothing to cancel.


async def test_drain_announces_draining_under_the_same_lease_waits_then_revokes(
    etcd: EtcdServer,
) -> None:
    seen: list[tuple[float, str | None]] = []
    loads = [2.0, 1.0, 0.0, 0.0, 0.0, 0.0]

    with trio.fail_after(20):
        async with open_etcd_client(etcd.url) as client, trio.open_nursery() as nursery:
            registration: Registration = await nursery.start(
                lambda task_status: serve_registration(
                    etcd.url, PREFIX, record_for("w0", URL), lease_ttl_s=30, task_status=task_status
                )
            )
            key = PREFIX + "w0"
            lease = registration.lease_id

            async def read_load() -> EngineLoad:
                # Each engine reading also records what a router would read in etcd then.
                now = await stored(client, key)
                status = None if now is None else str(now[0].get("status"))
                assert now is None or now[1] == lease
                seen.append((trio.current_time(), status))
                total = loads.pop(0)
                return EngineLoad(running=total, queued=0.0, handoff=0.0, kv_usage=None)

            started = trio.current_time()
            outcome = await drain_and_deregister(
                registration, read_load, DrainSettings(poll_interval_s=0.1, settle_s=0.3)
            )
            assert outcome.announced and outcome.deregistered
            assert outcome.drain.result is DrainResult.IDLE
            # Readings at 0, .1, .2 (first zero), .3, .4, .5 (zero held .3 s): six readings.
            assert outcome.drain.readings == 6 and loads == []
            assert [status for _, status in seen] == ["DRAINING"] * 6
            assert outcome.announce_s < 0.5 and outcome.deregister_s < 0.5
            assert 0.5 <= outcome.total_s < trio.current_time() - started + 0.001
            assert await stored(client, key) is None
            assert registration.statistics().lease_id is None


async def test_a_drain_cut_short_still_deregisters(etcd: EtcdServer) -> None:
    with trio.fail_after(20):
        async with open_etcd_client(etcd.url) as client, trio.open_nursery() as nursery:
            registration: Registration = await nursery.start(
                lambda task_status: serve_registration(
                    etcd.url, PREFIX, record_for("w0", URL), lease_ttl_s=30, task_status=task_status
                )
            )
            readings = 0

            async def busy() -> EngineLoad:
                nonlocal readings
                readings += 1
                if readings == 3:
                    cut.cancel()  # the second SIGTERM
                return EngineLoad(running=1.0, queued=0.0, handoff=0.0, kv_usage=None)

            with trio.CancelScope() as cut:
                await drain_and_deregister(
                    registration, busy, DrainSettings(poll_interval_s=0.05, settle_s=1.0)
                )
            assert cut.cancelled_caught and readings == 3
            assert await stored(client, PREFIX + "w0") is None

"""A frozen etcd (SIGSTOP: connections open, nothing answers) is reported within
`--discovery-silence-s`, the fleet stays and keeps serving, and SIGCONT brings discovery
back up. The fixture's etcd sends progress notifications every second, so a quiet watch
keeps talking and discovery stays up on a quiet fleet."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from router.cli.serve import RunningRouter
from tests.support.etcd_server import EtcdServer, open_etcd_server
from tests.support.etcd_workers import MODEL, open_etcd_router, record_for, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
SILENCE_S = 2.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def discovery_up(router: RunningRouter) -> float | None:
    return router.metrics.registry.get_sample_value("router_discovery_up")


async def test_a_frozen_etcd_is_reported_down_within_the_silence_window_and_up_after_it_thaws(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(90):
        async with open_fake_fleet(1, tokens=2) as fleet, trio.open_nursery() as nursery:
            worker = await register(
                nursery, etcd.url, record_for("w0", fleet[0].url), lease_ttl_s=60
            )
            async with (
                open_etcd_router(etcd.url, discovery_silence_s=SILENCE_S) as router,
                httpx.AsyncClient(base_url=router.url, timeout=10) as client,
            ):
                health = router.app.discovery
                await wait_until(lambda: len(router.fleet) == 1 and health.up)
                # Quiet prefix, no event for three silence windows: progress notifications
                # alone keep discovery up (a real wait: this is what is being shown).
                for _ in range(6):
                    await trio.sleep(SILENCE_S / 2)
                    assert health.up, health.detail
                etcd.freeze()
                try:
                    frozen_at = trio.current_time()
                    await wait_until(lambda: not health.up, interval_s=0.05)
                    took_s = trio.current_time() - frozen_at
                    assert discovery_up(router) == 0
                    assert "silent" in health.detail and "1 worker(s)" in health.detail
                    # Before the silence bound, a freeze was only seen when the watch's 30 s
                    # idle timeout fired; the margin here is for a loaded machine.
                    assert took_s < SILENCE_S + 10, took_s
                    # The last fleet stays and serves.
                    assert [w.id for w in router.fleet.workers()] == ["w0"]
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
                    body = (await client.get("/health")).json()
                    assert body["discovery"]["up"] is False
                finally:
                    etcd.thaw()
                await wait_until(lambda: health.up, interval_s=0.05)
                assert discovery_up(router) == 1
                assert (await client.get("/health")).json()["discovery"]["up"] is True
            worker.crash()


async def test_a_quiet_fleet_stays_up_on_probes_when_etcd_sends_no_progress_notifications(
    tmp_path: Path,
) -> None:
    """etcd's default progress interval is 10 minutes: the probe is the sign of life."""
    with trio.fail_after(60):
        async with (
            open_etcd_server(tmp_path / "etcd", progress_interval_s=600) as etcd,
            open_etcd_router(etcd.url, discovery_silence_s=1.0) as router,
        ):
            health = router.app.discovery
            await wait_until(lambda: health.up)
            for _ in range(8):  # four silence windows, a real wait
                await trio.sleep(0.5)
                assert health.up, health.detail
            assert discovery_up(router) == 1

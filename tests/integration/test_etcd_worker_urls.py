"""Worker URLs from etcd are checked where the record is parsed: a URL the pool could not
use is logged once, with why, and skipped; the rest of the fleet is served as usual."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest
import trio

from router.discovery.etcd_client import open_etcd_client
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import MODEL, PREFIX, open_etcd_router, record_for, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_URLS = {
    "tls": ("https://gpu-1:8000", "TLS to workers is not supported"),
    "unicode": ("http://gpü-2:8000", "must be ASCII"),
    "space": ("http://gpu-3:8000/v 1", "without spaces"),
    "userinfo": ("http://admin:pw@gpu-4:8000", "user name or password"),
    "query": ("http://gpu-5:8000/?x=1", "query or a fragment"),
}


def bad_record(key: str) -> bytes:
    return orjson.dumps({"id": key, "url": BAD_URLS[key][0], "model": MODEL})


async def test_records_with_urls_the_pool_cannot_use_are_logged_once_and_skipped(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.discovery.etcd")
    with trio.fail_after(30):
        async with open_fake_fleet(1, tokens=2) as fleet, trio.open_nursery() as nursery:
            async with open_etcd_client(etcd.url) as writer:
                for key in ("tls", "unicode", "space"):
                    await writer.put(PREFIX + key, bad_record(key))  # seen by the first listing
                await register(nursery, etcd.url, record_for("w0", fleet[0].url), lease_ttl_s=30)
                async with open_etcd_router(etcd.url) as router:
                    assert [w.id for w in router.fleet.workers()] == ["w0"]
                    for key in ("userinfo", "query"):
                        await writer.put(PREFIX + key, bad_record(key))  # seen by the watch
                    await writer.put(
                        PREFIX + "marker", orjson.dumps(record_for("w9", fleet[0].url).to_json())
                    )
                    await wait_until(lambda: router.fleet.get("w9") is not None)
                    assert sorted(w.id for w in router.fleet.workers()) == ["w0", "w9"]
                    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
                        for _ in range(4):
                            response = await client.post("/v1/chat/completions", json=CHAT)
                            assert response.status_code == 200
            nursery.cancel_scope.cancel()
    skipped = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    for key, (url, why) in BAD_URLS.items():
        about_key = [
            message
            for message in skipped
            if message.startswith(f"skipping the malformed worker record at {PREFIX}{key}:")
        ]
        assert len(about_key) == 1, skipped
        assert why in about_key[0] and repr(url) in about_key[0]
    assert fleet[0].worker.routing.dispatches == 4

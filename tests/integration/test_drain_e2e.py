"""Scale-down without a lost request: SIGTERM to a registered fake worker subprocess while
it streams a long generation and 30 more requests flow through the router."""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from router.discovery.etcd_client import open_etcd_client
from router.fake_worker.formats import expected_text
from tests.support.cli_process import open_cli, read_line, sse_text
from tests.support.etcd_server import EtcdServer
from tests.support.etcd_workers import MODEL, PREFIX, open_etcd_router, record_for, register
from tests.support.fake_fleet import open_fake_fleet
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
DRAINEE = "drainee"
LONG_TOKENS = 200
SETTLE_S = 1.0


async def test_sigterm_drains_a_registered_worker_with_no_failed_or_misrouted_request(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    log_path = tmp_path / "drainee.log"
    command = [
        "fake-worker",
        "--port",
        "0",
        "--register",
        f"etcd://127.0.0.1:{etcd.client_port}",
        "--etcd-prefix",
        PREFIX,
        "--worker-id",
        DRAINEE,
        "--tokens",
        str(LONG_TOKENS),
        "--token-latency-ms",
        "10",
        "--drain-settle-s",
        str(SETTLE_S),
    ]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with trio.fail_after(40):
            async with (
                open_fake_fleet(2, tokens=4) as fleet,
                trio.open_nursery() as nursery,
                open_cli(command, log_path=log_path) as drainee,
            ):
                for i, worker in enumerate(fleet):
                    await register(
                        nursery, etcd.url, record_for(f"w{i}", worker.url), lease_ttl_s=30
                    )
                assert (await read_line(drainee.stdout)).startswith("fake-worker listening on")
                async with (
                    open_etcd_router(etcd.url) as router,
                    httpx.AsyncClient(base_url=router.url, timeout=30) as client,
                ):
                    await wait_until(lambda: router.fleet.get(DRAINEE) is not None)
                    drainee_worker = router.fleet.get(DRAINEE)
                    assert drainee_worker is not None
                    streaming = trio.Event()
                    stream: dict[str, object] = {}

                    async def long_stream() -> None:
                        # Round robin: at most three tries until one lands on the drainee.
                        for _ in range(3):
                            async with client.stream(
                                "POST", "/v1/chat/completions", json={**chat, "stream": True}
                            ) as response:
                                assert response.status_code == 200
                                if response.headers["x-router-worker"] != DRAINEE:
                                    await response.aread()
                                    continue
                                streaming.set()
                                stream["body"] = await response.aread()
                                stream["ended"] = trio.current_time()
                                return
                        raise AssertionError("no stream reached the drainee")

                    flow = Traffic()
                    # Paced: the flow spans the drain.
                    send = partial(
                        client.post, "/v1/chat/completions", json={**chat, "max_tokens": 8}
                    )
                    async with trio.open_nursery() as traffic:
                        traffic.start_soon(long_stream)
                        await streaming.wait()
                        traffic.start_soon(partial(flow.keep_sending, send, most=30, pace_s=0.04))
                        await wait_until(lambda: len(flow.answers) >= 4)

                        drainee.send_signal(signal.SIGTERM)
                        sigterm_at = trio.current_time()
                        await wait_until(lambda: drainee_worker.draining, interval_s=0.001)
                        seen_at = trio.current_time()
                        await wait_until(lambda: router.fleet.get(DRAINEE) is None)
                        removed_at = trio.current_time()
                    assert await drainee.wait() == 0
                    exited_at = trio.current_time()

                    # 0 failures; the stream ran to its end.
                    sent = flow.answers
                    assert len(sent) == 30 and all(s.status == 200 for s in sent)
                    text, done = sse_text(stream["body"])  # type: ignore[arg-type]
                    assert done and text == expected_text(LONG_TOKENS)
                    # 0 new requests reached the drainee once the router saw DRAINING,
                    # and most of the flow was sent after that.
                    after = [s for s in sent if s.sent_at > seen_at]
                    assert len(after) >= 20
                    assert [s.worker for s in after if s.worker == DRAINEE] == []
                    assert {s.worker for s in after} == {"w0", "w1"}
                    # It left only after its stream ended and zero load held for the settle.
                    ended = stream["ended"]
                    assert isinstance(ended, float)
                    assert removed_at - ended >= SETTLE_S - 0.1
                    async with open_etcd_client(etcd.url) as etcd_client:
                        keys = [kv.key for kv in (await etcd_client.get_prefix(PREFIX)).kvs]
                    assert keys == [PREFIX + "w0", PREFIX + "w1"]

                    to_draining_s = seen_at - sigterm_at
                    print(
                        f"\nSIGTERM -> router stops sending new work (DRAINING seen): "
                        f"{to_draining_s * 1000:.1f} ms\n"
                        f"SIGTERM -> stream ended: {(ended - sigterm_at):.2f} s\n"
                        f"SIGTERM -> worker dropped from the fleet (key revoked): "
                        f"{(removed_at - sigterm_at):.2f} s\n"
                        f"SIGTERM -> process exited: {(exited_at - sigterm_at):.2f} s\n"
                        f"requests sent after DRAINING was seen: {len(after)} of 30"
                    )
                    assert to_draining_s < 1.0
                nursery.cancel_scope.cancel()
    finally:
        print(await trio.Path(log_path).read_text())

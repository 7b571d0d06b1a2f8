"""`router agent` as an operator runs it beside an engine (here a fake worker without
`--register`): it waits for health, registers, and on SIGTERM drains and deregisters."""

from __future__ import annotations

import signal
from contextlib import aclosing
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from router.discovery.etcd_client import WatchEvent, open_etcd_client
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.cli_process import open_cli, sse_text
from tests.support.etcd_server import EtcdServer
from tests.support.fake_fleet import open_fake_fleet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.etcd
PREFIX = "/e2e/workers/"
SETTLE_S = 0.5
TOKENS = 300


async def test_agent_waits_for_health_registers_and_drains_on_sigterm(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    log_path = tmp_path / "agent.log"
    engine = FakeWorkerSettings(tokens=TOKENS, token_latency_ms=10)
    events: list[tuple[float, WatchEvent]] = []
    try:
        with trio.fail_after(40):
            async with (
                open_fake_fleet([engine]) as fleet,
                open_etcd_client(etcd.url) as client,
                trio.open_nursery() as nursery,
            ):
                worker = fleet[0]
                # The engine is loading: its /health answers 503 until the test says so.
                worker.worker.behaviour.healthy = False
                head = (await client.get_prefix(PREFIX)).revision

                registered = trio.Event()

                async def record_events() -> None:
                    async with aclosing(client.watch_prefix(PREFIX, head + 1)) as watch:
                        async for batch in watch:
                            events.extend((trio.current_time(), event) for event in batch)
                            registered.set()

                nursery.start_soon(record_events)
                command = [
                    "agent",
                    "--engine-url",
                    worker.url,
                    "--model",
                    "fake-model",
                    "--role",
                    "mixed",
                    "--engine",
                    "sglang",
                    "--etcd-endpoint",
                    etcd.url,
                    "--etcd-prefix",
                    PREFIX,
                    "--worker-id",
                    "agent-w1",
                    "--lease-ttl-s",
                    "30",
                    "--health-poll-s",
                    "0.1",
                    "--drain-poll-s",
                    "0.1",
                    "--drain-settle-s",
                    str(SETTLE_S),
                    "--drain-timeout-s",
                    "30",
                ]
                async with open_cli(command, log_path=log_path) as agent:
                    # Judged by events, not by time: the agent polls a loading engine and
                    # registers nothing until its /health says 200.
                    await wait_until(lambda: worker.worker.routing.paths.get("/health", 0) >= 3)
                    assert events == []
                    worker.worker.behaviour.healthy = True
                    await registered.wait()
                    _, put = events[0]
                    assert (put.type, put.key) == ("PUT", PREFIX + "agent-w1")
                    assert orjson.loads(put.value) == {
                        "id": "agent-w1",
                        "url": worker.url,
                        "model": ["fake-model"],
                        "role": "mixed",
                        "engine": "sglang",
                        "dp_size": 1,
                        "dp_rank": None,
                    }

                    # A long generation straight at the engine, in flight at SIGTERM.
                    async with httpx.AsyncClient(base_url=worker.url, timeout=30) as engine_client:
                        body = {
                            "model": "fake-model",
                            "stream": True,
                            "messages": [{"role": "user", "content": "hi"}],
                        }
                        async with engine_client.stream(
                            "POST", "/v1/chat/completions", json=body
                        ) as response:
                            agent.send_signal(signal.SIGTERM)
                            signalled_at = trio.current_time()
                            streamed = await response.aread()
                            stream_ended_at = trio.current_time()
                    assert await agent.wait() == 0
                    exited_at = trio.current_time()

                text, done = sse_text(streamed)
                assert done and text == expected_text(TOKENS)
                kinds = [
                    (event.type, orjson.loads(event.value).get("status") if event.value else None)
                    for _, event in events
                ]
                assert kinds == [("PUT", None), ("PUT", "DRAINING"), ("DELETE", None)]
                draining_at, deleted_at = events[1][0], events[2][0]
                # DRAINING was announced while the generation still ran.
                assert draining_at < stream_ended_at
                # The key went only after the stream ended and zero held for the settle.
                assert deleted_at - stream_ended_at >= SETTLE_S - 0.05
                assert (await client.get_prefix(PREFIX)).kvs == []
                # The drain read the engine's load (at least at its start and after the settle).
                assert worker.worker.routing.paths.get("/metrics", 0) >= 2
                print(
                    f"\nSIGTERM -> DRAINING in etcd: {(draining_at - signalled_at) * 1000:.1f} ms; "
                    f"stream end -> key deleted: {deleted_at - stream_ended_at:.2f} s; "
                    f"SIGTERM -> exit: {exited_at - signalled_at:.2f} s"
                )
                nursery.cancel_scope.cancel()
    finally:
        print(await trio.Path(log_path).read_text())


async def test_agent_refuses_a_prefill_without_bootstrap_port(tmp_path: Path) -> None:
    command = [
        "agent",
        "--engine-url",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--role",
        "prefill",
        "--etcd-endpoint",
        "http://127.0.0.1:9",
    ]
    with trio.fail_after(20):
        async with open_cli(command, log_path=tmp_path / "agent.log") as agent:
            assert await agent.wait() == 2
    assert "--bootstrap-port" in await trio.Path(tmp_path / "agent.log").read_text()

"""`router agent` beside a real vLLM engine, registered in a real etcd, a router following
etcd: SIGTERM to the agent during a long stream lets the stream finish with [DONE], the
agent waits on the engine's own metrics, then deregisters."""

from __future__ import annotations

import re
import signal
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import cast

import httpx
import pytest
import trio

from conformance.engines import EngineSettings
from conformance.processes import OutputLog, open_process
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import (
    ROUTER_CLI,
    SSE,
    chat_body,
    event_kind,
    metric_sum,
    open_router,
    scrape,
)
from tests.support.etcd_server import EtcdServer

pytestmark = pytest.mark.etcd
MODEL = "tiny"
PREFIX = "/engine/workers/"
WORKER_ID = "vllm-1"
STREAM_TOKENS = 400
SETTLE_S = 1.0
POLL_S = 0.2


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    settings = EngineSettings(served_model_name=MODEL, extra_args=("--max-model-len", "2048"))
    yield from host_engines([settings], name="drain")


async def test_sigterm_to_the_agent_during_a_long_stream_drains_on_the_engines_metrics(
    host: EngineHost, etcd: EtcdServer
) -> None:
    engine = host.engines[0]
    agent_argv = [
        *ROUTER_CLI,
        "agent",
        "--engine-url",
        engine.url,
        "--model",
        MODEL,
        "--engine",
        "vllm",
        "--role",
        "mixed",
        "--etcd-endpoint",
        etcd.url,
        "--etcd-prefix",
        PREFIX,
        "--worker-id",
        WORKER_ID,
        "--health-poll-s",
        "0.2",
        "--drain-poll-s",
        str(POLL_S),
        "--drain-settle-s",
        str(SETTLE_S),
        "--drain-timeout-s",
        "240",
    ]
    body = chat_body(model=MODEL, max_tokens=STREAM_TOKENS, stream=True, ignore_eos=True)
    children: list[tuple[str, OutputLog]] = []
    try:
        # A 400-token stream took 84 s while other work loaded the machine (load 10-16).
        with trio.fail_after(420):
            async with (
                open_router(
                    "--discovery", "etcd", "--etcd-endpoint", etcd.url, "--etcd-prefix", PREFIX
                ) as router,
                open_process(agent_argv, "agent", stop_grace_s=5.0) as agent,
                httpx.AsyncClient(timeout=60) as client,
            ):
                children += [("router", router.child.output), ("agent", agent.output)]
                while not (await client.get(f"{router.url}/v1/workers")).json()["workers"]:  # noqa: ASYNC110
                    await trio.sleep(0.1)
                listed = (await client.get(f"{router.url}/v1/workers")).json()["workers"]
                assert [(w["id"], w["url"], w["status"]) for w in listed] == [
                    (WORKER_ID, engine.url, "ACTIVE")
                ]
                async with client.stream(
                    "POST", f"{router.url}/v1/chat/completions", json=body
                ) as stream:
                    assert stream.status_code == 200
                    received = b""
                    signalled_at: float | None = None
                    running: float | None = None
                    async with aclosing(cast(AsyncGenerator[bytes], stream.aiter_raw())) as chunks:
                        async for chunk in chunks:
                            received += chunk
                            if signalled_at is None and received.count(b"data: ") >= 5:
                                agent.process.send_signal(signal.SIGTERM)
                                signalled_at = trio.current_time()
                                samples = await scrape(client, engine.url)
                                running = metric_sum(samples, "vllm:num_requests_running")
                stream_ended_at = trio.current_time()
                agent_alive_at_stream_end = agent.process.returncode is None
                workers_after = (await client.get(f"{router.url}/v1/workers")).json()["workers"]
                status = await agent.process.wait()
                exited_at = trio.current_time()
                # The key is gone: the router no longer lists the worker.
                while (await client.get(f"{router.url}/v1/workers")).json()["workers"]:  # noqa: ASYNC110
                    await trio.sleep(0.1)
    finally:
        for name, output in children:
            print(f"\n{name} log:\n{output.tail(40)}")
    assert signalled_at is not None
    log = agent.output.tail(60)
    sse = SSE.parse(received)
    tokens = sum(1 for payload in sse.payloads() if event_kind(payload) == "token")
    idle = re.search(r"drain: engine idle for [\d.]+s, after ([\d.]+)s and (\d+) reading", log)
    print(
        f"drain: stream of {tokens} content events went on {stream_ended_at - signalled_at:.2f} s "
        f"after SIGTERM; agent exited {exited_at - stream_ended_at:.2f} s after the stream ended "
        f"(settle {SETTLE_S} s); log: {idle.group(0) if idle else None}"
    )
    assert agent_alive_at_stream_end, "the agent left before the stream it was draining ended"
    assert running == 1  # the engine's own gauge showed the stream when the agent was told
    assert sse.done and "error" not in sse.kinds()
    assert status == 0
    assert [w["status"] for w in workers_after] in ([], ["DRAINING"])
    assert idle is not None, "the agent did not report the engine idle from its metrics"
    waited_s, readings = float(idle.group(1)), int(idle.group(2))
    # It waited for the stream on the engine's gauges, then for the settle window.
    assert waited_s >= stream_ended_at - signalled_at
    assert readings >= 3
    assert exited_at - stream_ended_at >= SETTLE_S - POLL_S
    assert "cannot be read" not in log and "Traceback" not in log

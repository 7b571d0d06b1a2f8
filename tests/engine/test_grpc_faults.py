"""Faults on the gRPC path, on real engines: two vLLM engines serving their gRPC engine
service behind `router serve --worker grpc://...`.

- A client that leaves mid-stream stops the engine's generation: the engine's own
  `GetLoads` (its scheduler's running and waiting requests) reads the request while the
  client reads, and none soon after it leaves, long before the undisturbed generation of
  the same length would have ended.
- An engine SIGKILLed (its whole process group, as an OOM kill does) fails over: every
  request after the kill is answered 200 by the other engine, and the killed engine's
  breaker counts the faults.

The kill comes last: the module's engines are not restarted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import orjson
import pytest
import trio
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from conformance.engines import Engine, EngineSettings
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import RouterProcess, open_router

MODEL = "tiny"
LONG_TOKENS = 1800
"""A generation long enough that its undisturbed run takes seconds on this host (the
model's context is 2048)."""
STREAM: dict[str, Any] = {
    "model": MODEL,
    "prompt": "Tell me about the router",
    "max_tokens": LONG_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    yield from host_engines(
        [
            EngineSettings(served_model_name=MODEL, protocol="grpc"),
            EngineSettings(served_model_name=MODEL, protocol="grpc"),
        ],
        name="grpc-faults",
    )


@pytest.fixture
async def router(host: EngineHost) -> AsyncIterator[RouterProcess]:
    workers = [arg for e in host.engines for arg in ("--worker", f"{e.url},model={MODEL}")]
    async with open_router(*workers, "--policy", "round_robin") as running:
        yield running


def _engine_requests(engine: Engine) -> float:
    """Running plus waiting requests, as the engine's own scheduler counts them."""

    def read() -> float:
        with grpc.insecure_channel(engine.url.removeprefix("grpc://")) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
            return float(sum(load.num_running_reqs + load.num_waiting_reqs for load in loads.loads))

    return read()


async def engine_requests(engine: Engine) -> float:
    return await trio.to_thread.run_sync(_engine_requests, engine)


async def _wait_requests(engine: Engine, until: float, want: float) -> float:
    """Poll the engine's count until it is `want`; the seconds it took."""
    start = trio.current_time()
    with trio.fail_after(until):
        while await engine_requests(engine) != want:  # noqa: ASYNC110 - the engine's own counter
            await trio.sleep(0.1)
    return trio.current_time() - start


async def test_a_client_that_leaves_mid_stream_stops_the_engines_generation(
    host: EngineHost, router: RouterProcess
) -> None:
    a, b = host.engines
    for engine in (a, b):
        await host.ensure_running(engine)
        assert await engine_requests(engine) == 0
    # The undisturbed run of the same generation, for the scale of "soon".
    with trio.fail_after(600):
        async with httpx.AsyncClient(timeout=600) as client:
            started = trio.current_time()
            whole = await client.post(f"{router.url}/v1/completions", json=STREAM)
            undisturbed_s = trio.current_time() - started
    assert whole.status_code == 200
    assert whole.text.rstrip().endswith("data: [DONE]")
    assert undisturbed_s > 3.0, f"{undisturbed_s:.1f} s is too short to tell an abort apart"
    # The same request again; the client reads its first events and leaves.
    host_port = router.url.removeprefix("http://")
    address, port = host_port.rsplit(":", 1)
    body = orjson.dumps(STREAM)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host_port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    with trio.fail_after(120):
        stream = await trio.open_tcp_stream(address, int(port))
        await stream.send_all(head + body)
        received = b""
        while received.count(b"data: ") < 3:
            received += await stream.receive_some(65536)
        busy = await engine_requests(a) + await engine_requests(b)
        await stream.aclose()
        left_at = trio.current_time()
        # The stream was on one of the two; both are read until neither has it.
        for engine in (a, b):
            await _wait_requests(engine, SETTLE_S, 0)
        stopped_s = trio.current_time() - left_at
    print(
        f"\nundisturbed {LONG_TOKENS}-token stream: {undisturbed_s:.1f} s; "
        f"after the client left, the engines counted no request within {stopped_s:.2f} s"
    )
    assert b"200 OK" in received.split(b"\r\n", 1)[0]
    assert busy == 1  # the engine counted the stream while the client read it
    assert stopped_s < undisturbed_s / 2


async def test_a_killed_engine_fails_over_to_the_other(
    host: EngineHost, router: RouterProcess
) -> None:
    a, b = host.engines
    for engine in (a, b):
        await host.ensure_running(engine)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=120) as client:
            # Both engines served before the kill (round robin), so the router holds a
            # connection to each.
            before = [
                (await client.post(f"{router.url}/v1/chat/completions", json=chat)).headers.get(
                    "x-router-worker"
                )
                for _ in range(2)
            ]
            # Not awaited here: the engine's process belongs to the engine host's trio loop
            # (waiting on it from this loop brings the host down), and SIGKILL is at once.
            a.kill()
            answers = []
            for stream in (False, True) * 3:
                answers.append(
                    await client.post(
                        f"{router.url}/v1/chat/completions", json={**chat, "stream": stream}
                    )
                )
            workers = {
                w["url"]: w
                for w in (await client.get(f"{router.url}/v1/workers")).json()["workers"]
            }
    print(
        f"\nafter the kill: {[(r.status_code, r.headers.get('x-router-worker')) for r in answers]}; "
        f"the killed engine's breaker: {workers[a.url]['breaker']}"
    )
    assert sorted(before) == sorted([a.url, b.url])
    assert [r.status_code for r in answers] == [200] * 6
    assert {r.headers["x-router-worker"] for r in answers} == {b.url}
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in answers[1::2])
    assert workers[a.url]["breaker"]["consecutive_faults"] >= 1

"""The router's handler under hypercorn (`--server hypercorn`), over real loopback sockets."""

from __future__ import annotations

import dataclasses

import httpx
import orjson
import pytest
import trio

from router.fake_worker.settings import FakeWorkerSettings
from router.http.server.asgi import serve_asgi
from router.http.server.loop import serve_http
from router.http.server.messages import Request, ResponseWriter
from router.http.server.settings import ServerSettings
from tests.support.fake_fleet import open_fake_fleet
from tests.support.http_client import RawClient
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
JSON = [("content-type", "application/json")]


async def test_unary_and_streaming_reach_the_worker_through_hypercorn() -> None:
    with trio.fail_after(30):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([fleet[0].url], server="hypercorn") as router,
        ):
            async with httpx.AsyncClient(base_url=router.url) as http:
                response = await http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200
            assert response.headers["server"].startswith("hypercorn")
            assert response.headers["x-router-worker"] == fleet[0].url
            assert response.json()["usage"]["completion_tokens"] == 5

            client = await RawClient.connect(router.port)
            body = orjson.dumps({**CHAT, "stream": True})
            streamed = await client.request("POST", "/v1/chat/completions", JSON, body)
            await client.aclose()
            assert streamed.status == 200
            assert streamed.header(b"transfer-encoding") == b"chunked"
            events = [e for e in streamed.body.split(b"\n\n") if e]
            # The role event, 5 tokens, the finish event, [DONE].
            assert len(events) == 8
            assert events[-1] == b"data: [DONE]"
            assert fleet[0].worker.routing.dispatches == 2


async def test_client_disconnect_mid_stream_reaches_the_worker() -> None:
    slow = dataclasses.replace(FakeWorkerSettings(), tokens=200, token_latency_ms=20)
    with trio.fail_after(30):
        async with (
            open_fake_fleet([slow]) as fleet,
            open_router([fleet[0].url], server="hypercorn") as router,
        ):
            client = await RawClient.connect(router.port)
            body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 200})
            await client.send_request("POST", "/v1/chat/completions", JSON, body)
            assert (await client.read_head("POST")).status == 200
            assert (await client.read_chunk() or b"").startswith(b"data: ")
            await client.aclose()
            left_at = trio.current_time()
            with trio.fail_after(2):
                await wait_until(lambda: fleet[0].worker.routing.disconnects >= 1)
            # Far less than the 4 s the remaining 200 tokens would take.
            assert trio.current_time() - left_at < 2
            with trio.fail_after(2):
                await wait_until(lambda: router.fleet.workers()[0].inflight == 0)
            assert fleet[0].worker.routing.inflight == 0
            assert fleet[0].worker.routing.dispatches == 1


async def test_client_leaving_while_the_worker_is_silent_cancels_the_upstream_call() -> None:
    # No write can fail while the worker is silent: only http.disconnect tells.
    silent = dataclasses.replace(FakeWorkerSettings(), ttft_ms=20_000)
    with trio.fail_after(30):
        async with (
            open_fake_fleet([silent]) as fleet,
            open_router([fleet[0].url], server="hypercorn") as router,
        ):
            client = await RawClient.connect(router.port)
            await client.send_request("POST", "/v1/chat/completions", JSON, orjson.dumps(CHAT))
            with trio.fail_after(2):
                await wait_until(lambda: fleet[0].worker.routing.inflight >= 1)
            await client.aclose()
            with trio.fail_after(2):
                await wait_until(lambda: fleet[0].worker.routing.disconnects >= 1)
            with trio.fail_after(2):
                await wait_until(lambda: router.fleet.workers()[0].inflight == 0)
            assert fleet[0].worker.routing.inflight == 0
            assert fleet[0].worker.routing.dispatches == 1


async def test_oversize_body_is_refused_before_any_dispatch() -> None:
    with trio.fail_after(30):
        async with (
            open_fake_fleet(1) as fleet,
            open_router([fleet[0].url], server="hypercorn", max_body_bytes=1000) as router,
        ):
            padded = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
            async with httpx.AsyncClient(base_url=router.url) as http:
                response = await http.post("/v1/chat/completions", json=padded)
                missing = await http.get("/no/such/route")
            assert response.status_code == 413
            assert response.json()["error"]["code"] == "payload_too_large"
            assert missing.status_code == 404
            assert fleet[0].worker.routing.dispatches == 0


async def _hello(request: Request, writer: ResponseWriter) -> None:
    await writer.respond(200, [(b"content-type", b"text/plain")], b"hello")


async def test_both_fronts_share_a_port_only_with_reuse_port() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shared = ServerSettings(reuse_port=True)
            port = await nursery.start(serve_http, _hello, shared)
            same = dataclasses.replace(shared, port=port)
            assert await nursery.start(serve_asgi, _hello, same) == port
            with pytest.raises(OSError):
                await serve_http(_hello, dataclasses.replace(same, reuse_port=False))
            async with httpx.AsyncClient() as http:
                servers = set()
                for _ in range(40):
                    # A new connection each time, so the kernel picks a listener each time.
                    response = await http.get(
                        f"http://127.0.0.1:{port}/", headers={"connection": "close"}
                    )
                    assert response.text == "hello"
                    servers.add(response.headers["server"].split("-")[0])
            # The kernel spreads connections by a hash of the client's address and port.
            assert servers == {"trio", "hypercorn"}
            nursery.cancel_scope.cancel()

"""The router out of file descriptors, or at a worker's connection cap: its own trouble,
never the workers' fault.

`router serve` runs as a user runs it, with `RLIMIT_NOFILE` lowered so that a flood of
concurrent requests exhausts it. Requests that cannot get an upstream socket are refused
with 503 `router_overloaded` and `Retry-After`; no breaker trips (the threshold is 1, so
a single misplaced fault would show), and every lease is released.
"""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson
import trio

from tests.adversarial.upstream_stubs import GOOD_JSON, chat, open_edge
from tests.support.cli_process import REPO
from tests.support.raw_upstream import Exchange, open_raw_upstream

GUARD_S = 60
FLOOD = 60
# About 11 descriptors are open once the router listens; this leaves a dozen for clients
# and upstream connections together, far fewer than the flood needs.
NOFILE_LIMIT = 24


async def slow_answer(exchange: Exchange) -> None:
    """Holds each request a while, so the flood's requests are in flight together."""
    if exchange.request.method == b"POST":
        await trio.sleep(0.5)  # real time: the work that keeps sockets busy
    await exchange.respond(200, [(b"content-type", b"application/json")], GOOD_JSON)


def _limit_descriptors() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_LIMIT, hard))


@asynccontextmanager
async def open_starved_router(*worker_urls: str) -> AsyncIterator[tuple[str, list[bytes]]]:
    args = [
        "serve",
        "--port",
        "0",
        "--health-interval-s",
        "3600",
        "--breaker-failure-threshold",
        "1",
    ]
    for url in worker_urls:
        args += ["--worker", f"{url},model=m"]
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "router.cli", *args],
        stderr=subprocess.PIPE,
        cwd=REPO,
        preexec_fn=_limit_descriptors,
    )
    assert process.stderr is not None
    log: list[bytes] = []
    try:
        async with process.stderr, trio.open_nursery() as nursery:
            listening = trio.Event()
            url: list[str] = []

            async def pump() -> None:
                assert process.stderr is not None
                pending = b""
                while chunk := await process.stderr.receive_some(65536):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    log.extend(lines)
                    for line in lines:
                        if match := re.search(rb"router listening on (http://\S+)", line):
                            url.append(match.group(1).decode())
                            listening.set()

            nursery.start_soon(pump)
            await listening.wait()
            yield url[0], log
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()


async def test_a_descriptor_flood_is_refused_with_503_and_trips_no_breaker() -> None:
    statuses: list[int] = []
    codes: list[str] = []

    async def one(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/chat/completions", json=chat())
        statuses.append(response.status_code)
        if response.status_code != 200:
            codes.append(orjson.loads(response.content)["error"]["code"])
            assert response.headers["retry-after"] == "1"

    with trio.fail_after(GUARD_S):
        async with (
            open_raw_upstream(slow_answer) as first,
            open_raw_upstream(slow_answer) as second,
            open_starved_router(first.url, second.url) as (router_url, log),
        ):
            # No keep-alive: each request holds its client socket only while it runs.
            limits = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=router_url, timeout=30, limits=limits) as client:
                async with trio.open_nursery() as nursery:
                    for _ in range(FLOOD):
                        nursery.start_soon(one, client)
                workers = (await client.get("/v1/workers")).json()["workers"]
                metrics = (await client.get("/metrics")).text

    text = b"\n".join(log).decode(errors="replace")
    assert len(statuses) == FLOOD
    assert set(statuses) <= {200, 503}, (statuses, text[-3000:])
    assert set(codes) == {"router_overloaded"}, text[-3000:]
    assert statuses.count(200) >= 1
    assert {(w["breaker"]["state"], w["breaker"]["trips"], w["inflight"]) for w in workers} == {
        ("closed", 0, 0)
    }
    refused = re.search(r'router_local_errors_total\{kind="emfile"\} (\S+)', metrics)
    assert refused is not None and float(refused.group(1)) == len(codes)
    assert "Traceback" not in text


async def test_checkouts_past_the_connection_cap_wait_then_get_503_router_overloaded() -> None:
    async def busy(exchange: Exchange) -> None:
        await trio.sleep(1.0)  # real time: holds the worker's one allowed connection
        await exchange.respond(200, [(b"content-type", b"application/json")], GOOD_JSON)

    statuses: list[int] = []
    codes: list[str] = []

    async def one(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/chat/completions", json=chat(model="solo"))
        statuses.append(response.status_code)
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
            codes.append(response.json()["error"]["code"])

    with trio.fail_after(GUARD_S):
        async with open_edge(
            busy,
            max_connections_per_worker=1,
            connect_timeout_s=0.3,
            breaker_failure_threshold=1,
        ) as edge:
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(one, edge.client)
            assert sorted(statuses) == [200, 503, 503]
            assert codes == ["router_overloaded"] * 2
            assert edge.bad_dispatches.count == 1
            assert await edge.counter("router_local_errors_total") == {"pool_wait_timeout": 2}
            breaker = (await edge.workers())[edge.bad.url]["breaker"]
            assert (breaker["state"], breaker["consecutive_faults"]) == ("closed", 0)
            await edge.assert_no_harm_left(bad_answers_were_valid=True)

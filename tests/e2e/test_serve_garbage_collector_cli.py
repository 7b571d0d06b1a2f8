"""`router serve` settles Python's garbage collector once it serves: what start-up built
is frozen and young collections become rare, so a request no longer waits on a full
collection walking every object the process holds. Counted from its own `/metrics`."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.support.cli_process import open_cli_piped

REQUESTS = 1_600
CLIENTS = 32
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _samples(text: str) -> dict[str, float]:
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in text.splitlines())
        if name and not name.startswith("#")
    }


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return _samples(response.text)


async def _settled(client: httpx.AsyncClient, *, frozen: bool) -> dict[str, float]:
    """The scrape once `settle` has run (it runs right after the listening line)."""
    with trio.fail_after(10):
        while True:
            samples = await _scrape(client)
            if (samples["router_gc_frozen_objects"] > 0) == frozen:
                return samples
            await trio.sleep(0.01)


async def _collections_over_requests(threshold: str | None) -> tuple[dict[str, float], float]:
    """Young and full collections during REQUESTS chats, and the frozen objects."""
    settings = [] if threshold is None else ["--gc-young-threshold", threshold]
    async with open_cli_piped("fake-worker", "--port", "0") as (worker, worker_out, _):
        worker_url = await worker_out.url(r"^fake-worker listening on (http://\S+)$")
        async with open_cli_piped("serve", "--port", "0", "--worker", worker_url, *settings) as (
            _,
            _,
            router_err,
        ):
            router_url = await router_err.url(r"router listening on (http://\S+) with 1 workers")
            async with httpx.AsyncClient(base_url=router_url, timeout=10) as client:
                before = await _settled(client, frozen=threshold is None)

                async def chat(count: int) -> None:
                    for _ in range(count):
                        response = await client.post("/v1/chat/completions", json=BODY)
                        assert response.status_code == 200

                async with trio.open_nursery() as nursery:
                    for _ in range(CLIENTS):
                        nursery.start_soon(chat, REQUESTS // CLIENTS)
                after = await _scrape(client)
        worker.kill()
    delta = {
        generation: after[f'python_gc_collections_total{{generation="{generation}"}}']
        - before[f'python_gc_collections_total{{generation="{generation}"}}']
        for generation in ("0", "2")
    }
    assert 'router_gc_pause_seconds_total{generation="2"}' in after
    return delta, after["router_gc_frozen_objects"]


@pytest.mark.parametrize("threshold", [None, "0"], ids=["default", "pythons-own"])
async def test_a_serving_router_collects_rarely_and_never_in_full(threshold: str | None) -> None:
    with trio.fail_after(60):
        delta, frozen = await _collections_over_requests(threshold)
    if threshold is None:
        assert frozen > 10_000  # start-up's objects: modules, classes, the app
        assert delta == {"0": 0, "2": 0}
    else:
        # Python's own settings, for contrast (4-5 young collections here: the clients
        # are this test's, slower than the router, so few requests are in flight at once).
        assert frozen == 0
        assert delta["0"] >= 1

"""The router in front of a real vLLM engine: answers equal the engine's own in shape, a
client that leaves aborts the engine's work, the engine's own 400 passes verbatim and trips
nothing, an unknown model is a 404, and the worker is listed as the engine it is."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import trio

from conformance.engines import Engine, EngineSettings
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import (
    SSE,
    RouterProcess,
    chat_body,
    metric_sum,
    open_raw_stream,
    open_router,
    scrape,
    shape,
    shape_diff,
)

MODEL = "tiny"
MAX_MODEL_LEN = 2048
ABORT_MAX_TOKENS = 1900


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    settings = EngineSettings(
        served_model_name=MODEL, extra_args=("--max-model-len", str(MAX_MODEL_LEN))
    )
    yield from host_engines([settings], name="front")


@pytest.fixture
def engine(host: EngineHost) -> Engine:
    return host.engines[0]


@pytest.fixture
async def router(engine: Engine) -> AsyncIterator[RouterProcess]:
    async with open_router("--worker", engine.url, "--health-interval-s", "1") as process:
        yield process


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _unary(base: str, route: str) -> dict[str, Any]:
    client = _openai(base)
    if route == "chat":
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me about the router"}],
            max_tokens=12,
            temperature=0,
        )
        return chat.to_dict()
    completion = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0
    )
    return completion.to_dict()


def _streamed(base: str, route: str, include_usage: bool) -> list[dict[str, Any]]:
    client = _openai(base)
    options: Any = {"include_usage": True} if include_usage else openai.NOT_GIVEN
    if route == "chat":
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me about the router"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options=options,
        )
        return [chunk.to_dict() for chunk in chat]
    completion = client.completions.create(
        model=MODEL,
        prompt="the quick brown fox",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options=options,
    )
    return [chunk.to_dict() for chunk in completion]


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_unary_answer_through_the_router_equals_the_engines_in_shape(
    engine: Engine, router: RouterProcess, route: str
) -> None:
    with trio.fail_after(60):
        direct = await trio.to_thread.run_sync(_unary, engine.url, route)
        routed = await trio.to_thread.run_sync(_unary, router.url, route)
    assert shape_diff(shape(direct), shape(routed)) == []
    assert routed["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert routed["usage"] == direct["usage"]
    assert routed["object"] == direct["object"]
    assert routed["model"] == MODEL


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_streamed_answer_through_the_router_equals_the_engines_in_shape(
    engine: Engine, router: RouterProcess, route: str, include_usage: bool
) -> None:
    with trio.fail_after(60):
        direct = await trio.to_thread.run_sync(_streamed, engine.url, route, include_usage)
        routed = await trio.to_thread.run_sync(_streamed, router.url, route, include_usage)
    assert shape_diff(shape(direct), shape(routed)) == []
    finish = [c["choices"][0]["finish_reason"] for c in routed if c["choices"]]
    assert finish[-1] == [c["choices"][0]["finish_reason"] for c in direct if c["choices"]][-1]
    usage = [chunk for chunk in routed if chunk.get("usage")]
    if include_usage:
        # The last chunk carries the usage and no choices, as the engine sends it.
        assert usage == [routed[-1]] and routed[-1]["choices"] == []
        assert routed[-1]["usage"] == direct[-1]["usage"]
    else:
        assert usage == []


@pytest.mark.parametrize("include_usage", [True, False])
async def test_sse_framing_through_the_router_is_the_engines(
    engine: Engine, router: RouterProcess, include_usage: bool
) -> None:
    body = chat_body(model=MODEL, max_tokens=8, stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=30) as client:
            direct = await client.post(f"{engine.url}/v1/chat/completions", json=body)
            routed = await client.post(f"{router.url}/v1/chat/completions", json=body)
    assert routed.status_code == direct.status_code == 200
    # The media type is the engine's; the router drops its `; charset=utf-8` (SSE is UTF-8
    # by definition, so a client reads the same).
    assert _media_type(routed) == _media_type(direct) == "text/event-stream"
    direct_sse, routed_sse = SSE.parse(direct.content), SSE.parse(routed.content)
    assert routed_sse.kinds() == direct_sse.kinds()
    assert direct_sse.done and routed_sse.done
    # Every event is `data: ...` and a blank line, as the engine wrote it.
    assert routed.content.endswith(b"data: [DONE]\n\n")
    assert routed.content.count(b"\n\n") == direct.content.count(b"\n\n")
    assert [shape(p) for p in routed_sse.payloads()] == [shape(p) for p in direct_sse.payloads()]


def _media_type(response: httpx.Response) -> str:
    return response.headers["content-type"].split(";")[0].strip()


async def test_a_client_that_leaves_mid_stream_aborts_the_engines_request(
    engine: Engine, router: RouterProcess
) -> None:
    body = chat_body(model=MODEL, max_tokens=ABORT_MAX_TOKENS, stream=True, ignore_eos=True)
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=30) as client:
            before = metric_sum(await scrape(client, engine.url), "vllm:generation_tokens_total")
            assert before is not None
            async with open_raw_stream(router.url, "/v1/chat/completions", body) as stream:
                received = await stream.read_events(20)
                running = metric_sum(await scrape(client, engine.url), "vllm:num_requests_running")
                assert running == 1
                # Without --enable-server-load-tracking, /load says 0 whatever the engine
                # holds: the load reader never takes that 0 for idle (docs/policies.md).
                assert (await client.get(f"{engine.url}/load")).json() == {"server_load": 0}
            left_at = trio.current_time()
            # Leaving the block closed the client's connection mid-stream.
            while True:
                samples = await scrape(client, engine.url)
                if metric_sum(samples, "vllm:num_requests_running") == 0:
                    break
                await trio.sleep(0.02)
            idle_after_s = trio.current_time() - left_at
            at_idle = metric_sum(samples, "vllm:generation_tokens_total")
            await trio.sleep(2.0)
            later = metric_sum(await scrape(client, engine.url), "vllm:generation_tokens_total")
    assert at_idle is not None and later is not None
    generated = later - before
    print(
        f"\nabort: {received} events read, engine idle {idle_after_s * 1000:.0f} ms after the "
        f"client left, {generated:.0f} of {ABORT_MAX_TOKENS} tokens generated"
    )
    assert idle_after_s < 1.0
    assert later == at_idle  # nothing generated after the engine went idle
    assert generated < ABORT_MAX_TOKENS / 2


async def _post_pair(
    engine: Engine, router: RouterProcess, body: dict[str, Any]
) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await client.post(f"{engine.url}/v1/completions", json=body)
        routed = await client.post(f"{router.url}/v1/completions", json=body)
    return direct, routed


async def test_the_engines_own_400_reaches_the_client_verbatim_and_trips_nothing(
    engine: Engine, router: RouterProcess
) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": MAX_MODEL_LEN + 10}
    with trio.fail_after(60):
        # More than the breaker's threshold (3) of them: a 4xx is never a fault.
        pairs = [await _post_pair(engine, router, body) for _ in range(5)]
        async with httpx.AsyncClient(timeout=10) as client:
            workers = (await client.get(f"{router.url}/v1/workers")).json()["workers"]
            samples = await scrape(client, router.url)
    for direct, routed in pairs:
        assert direct.status_code == 400
        assert (routed.status_code, routed.content) == (direct.status_code, direct.content)
        assert routed.headers["content-type"] == direct.headers["content-type"]
    print(f"\nengine 400 body: {pairs[0][0].text}")
    assert metric_sum(samples, "router_worker_breaker_trips_total") in (None, 0.0)
    assert metric_sum(samples, "router_worker_breaker_state") == 0.0
    assert [w["breaker"]["state"] for w in workers] == ["closed"]
    assert [w["breaker"]["consecutive_faults"] for w in workers] == [0]


async def test_an_unknown_model_is_404_model_not_found(router: RouterProcess) -> None:
    with trio.fail_after(30):
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(
                f"{router.url}/v1/chat/completions", json=chat_body(model="no-such-model")
            )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert "no-such-model" in error["message"]


async def test_the_worker_is_listed_as_the_vllm_engine_it_is(
    engine: Engine, router: RouterProcess
) -> None:
    with trio.fail_after(30):
        async with httpx.AsyncClient(timeout=10) as client:
            workers = (await client.get(f"{router.url}/v1/workers")).json()["workers"]
    assert [(w["url"], w["model"]) for w in workers] == [(engine.url, [MODEL])]
    # Learned from what the engine serves (issue 24, item 2), never assumed.
    assert [w["engine"] for w in workers] == ["vllm"]

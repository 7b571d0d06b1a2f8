"""A broken stream goes on on another worker, token for token, over real loopback sockets:
fake vLLM workers that break mid-stream (reset, stall), the router, a client.

Each resumed stream is held to the unbroken one: the same text, one `id`, one `usage`
adding up, one `[DONE]`; and each stream that cannot go on ends with the API's error event
and is counted with its reason. Costs are read from the workers' own counters.
"""

from __future__ import annotations

import gc
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import trio

from router.cli.serve import RunningRouter
from router.fake_worker.behaviour import FailMode
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from router.fake_worker.vocabulary import write_tokenizer
from router.pipeline.dispatch import StreamBroken
from tests.support.cli_process import open_cli_piped
from tests.support.failover import dispatches, scrape
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.router_instance import open_router

GUARD_S = 20
MODEL = "fake-model"
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me about the cache"}],
    "max_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
}
COMPLETIONS: dict[str, Any] = {
    "model": MODEL,
    "prompt": "tell me about the cache",
    "max_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BODIES = {"chat": CHAT, "completions": COMPLETIONS}
VLLM = FakeWorkerSettings(engine="vllm")


def breaks_at(k: int, **changes: Any) -> FakeWorkerSettings:
    """A vLLM fake whose first stream breaks after `k` events (its connection closed)."""
    return FakeWorkerSettings(
        engine="vllm", fail_first=1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=k, **changes
    )


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tokenizer(tmp_path_factory.mktemp("fake") / "tokenizer.json"))


def worker_spec(handle: FakeWorkerHandle) -> str:
    settings = handle.settings
    parts = [handle.url, f"model={MODEL}", f"engine={settings.engine}", f"role={settings.role}"]
    if settings.role == "prefill":
        parts.append(f"bootstrap_port={settings.bootstrap_port}")
    return ",".join(parts)


@asynccontextmanager
async def resuming_fleet(
    settings: Sequence[FakeWorkerSettings], **overrides: Any
) -> AsyncIterator[tuple[list[FakeWorkerHandle], RunningRouter, httpx.AsyncClient]]:
    overrides.setdefault("policy", "round_robin")
    async with (
        open_fake_fleet(settings) as fleet,
        open_router([worker_spec(w) for w in fleet], **overrides) as router,
        httpx.AsyncClient(base_url=router.url, timeout=10) as client,
    ):
        yield fleet, router, client


class Stream:
    """What a client made of one streamed answer."""

    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.worker = response.headers.get("x-router-worker")
        self.text = ""
        self.ids: set[tuple[Any, Any, Any]] = set()
        self.usage: list[dict[str, Any]] = []
        self.finish: list[Any] = []
        self.done = 0
        self.errors: list[dict[str, Any]] = []
        for block in response.text.split("\n\n"):
            lines = block.strip().splitlines()
            if not lines:
                continue
            data = lines[-1].removeprefix("data: ")
            if data == "[DONE]":
                self.done += 1
                continue
            chunk = orjson.loads(data)
            if lines[0] == "event: error" or "error" in chunk:
                self.errors.append(chunk["error"])
                continue
            self.ids.add((chunk["id"], chunk["created"], chunk["model"]))
            if chunk.get("usage"):
                self.usage.append(chunk["usage"])
            for choice in chunk["choices"]:
                delta = choice.get("delta")
                self.text += (delta.get("content") or "") if delta is not None else choice["text"]
                if choice["finish_reason"] is not None:
                    self.finish.append((choice["finish_reason"], choice.get("stop_reason")))


async def post(client: httpx.AsyncClient, route: str, **changes: Any) -> Stream:
    body = {**BODIES[route], **changes}
    return Stream(await client.post(PATHS[route], json=body))


async def outcomes(client: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["outcome"], dict(labels).get("route", "")): value
        for labels, value in (await scrape(client, "router_resumes_total")).items()
    }


async def refusals(client: httpx.AsyncClient) -> dict[str, float]:
    return {
        dict(labels)["reason"]: value
        for labels, value in (await scrape(client, "router_resume_refusals_total")).items()
    }


def assert_whole(stream: Stream, tokens: int = 12, prompt: int = 5) -> None:
    assert stream.status == 200
    assert stream.errors == []
    assert stream.text == expected_text(tokens)
    assert len(stream.ids) == 1
    assert stream.usage == [
        {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    ]
    assert stream.done == 1


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("k", [1, 4, 11])
async def test_a_stream_broken_after_k_events_goes_on_token_for_token(
    route: str, k: int, vocabulary: str
) -> None:
    with trio.fail_after(GUARD_S):
        async with resuming_fleet([breaks_at(k), VLLM], kv_tokenizer=vocabulary) as (
            fleet,
            _,
            client,
        ):
            stream = await post(client, route)
            counted = await outcomes(client)
    broken, good = fleet
    assert_whole(stream)
    assert stream.worker == broken.url  # the stream began there
    assert (dispatches(broken), dispatches(good)) == (1, 1)
    assert counted == {("resumed", route): 1}


async def test_a_stop_string_across_the_seam_ends_where_the_unbroken_run_ends(
    vocabulary: str,
) -> None:
    stop = {"stop": ["3 tok4 t"], "max_tokens": 12}
    with trio.fail_after(GUARD_S):
        async with resuming_fleet([VLLM, breaks_at(3)], kv_tokenizer=vocabulary) as (
            fleet,
            _,
            client,
        ):
            unbroken = await post(client, "completions", **stop)  # on the first worker
            fleet[0].worker.behaviour.update({"fail_first": 0})
            resumed = await post(client, "completions", **stop)  # breaks on the second
            counted = await outcomes(client)
    assert unbroken.text == resumed.text == "tok0 tok1 tok2 tok"
    assert unbroken.finish == resumed.finish == [("stop", "3 tok4 t")]
    assert unbroken.usage == resumed.usage
    assert (resumed.done, len(resumed.ids)) == (1, 1)
    assert counted == {("resumed", "completions"): 1}


async def test_a_stream_stalled_past_the_idle_timeout_goes_on_elsewhere(vocabulary: str) -> None:
    slow = FakeWorkerSettings(engine="vllm", token_latency_ms=5000)
    with trio.fail_after(GUARD_S):
        async with resuming_fleet(
            [slow, VLLM], kv_tokenizer=vocabulary, stream_idle_timeout_s=0.5
        ) as (fleet, _, client):
            stream = await post(client, "chat")
            counted = await outcomes(client)
    assert_whole(stream)
    assert [dispatches(w) for w in fleet] == [1, 1]
    # The silent worker's generation was ended with its connection.
    assert fleet[0].worker.routing.disconnects == 1
    assert counted == {("resumed", "chat"): 1}


# Round robin takes the first worker, then (among the untried) the third, then the second.
async def test_each_break_resumes_up_to_the_limit(vocabulary: str) -> None:
    with trio.fail_after(GUARD_S):
        async with resuming_fleet(
            [breaks_at(3), VLLM, breaks_at(3)], kv_tokenizer=vocabulary, resume_limit=2
        ) as (fleet, _, client):
            stream = await post(client, "completions")
            counted = await outcomes(client)
    assert_whole(stream)
    assert [dispatches(w) for w in fleet] == [1, 1, 1]
    assert counted == {("resumed", "completions"): 2}


async def test_past_the_limit_the_stream_ends_with_the_error_event(vocabulary: str) -> None:
    with trio.fail_after(GUARD_S):
        async with resuming_fleet(
            [breaks_at(3), VLLM, breaks_at(3)], kv_tokenizer=vocabulary, resume_limit=1
        ) as (fleet, _, client):
            stream = await post(client, "completions")
            counted = await outcomes(client)
            why = await refusals(client)
    assert [e["code"] for e in stream.errors] == ["stream_interrupted"]
    assert stream.done == 0
    # tok0 tok1 tok2 from the first worker, three more before the continuation broke.
    assert stream.text == expected_text(6)
    assert [dispatches(w) for w in fleet] == [1, 0, 1]
    assert counted == {("resumed", "completions"): 1, ("refused", "completions"): 1}
    assert why == {"limit": 1}


async def test_with_no_worker_left_the_resume_fails_with_the_error_event(vocabulary: str) -> None:
    with trio.fail_after(GUARD_S):
        async with resuming_fleet([breaks_at(3)], kv_tokenizer=vocabulary) as (_, _, client):
            stream = await post(client, "chat")
            counted = await outcomes(client)
    assert [e["code"] for e in stream.errors] == ["stream_interrupted"]
    assert stream.text == expected_text(2)  # the role event, then two tokens
    assert counted == {("failed", "chat"): 1}


@pytest.mark.parametrize(
    ("settings", "changes", "headers", "reason"),
    [
        ({}, {"n": 2}, {}, "n"),
        ({}, {}, {"x-router-resume": "off"}, "disabled"),
        ({"kv_tokenizer": ""}, {}, {}, "no_tokenizer"),
        ({"resume_routes": "completions"}, {}, {}, "disabled"),
    ],
)
async def test_a_stream_that_cannot_resume_ends_as_before_and_says_why(
    settings: dict[str, Any],
    changes: dict[str, Any],
    headers: dict[str, str],
    reason: str,
    vocabulary: str,
) -> None:
    settings = {"kv_tokenizer": vocabulary, **settings}
    with trio.fail_after(GUARD_S):
        async with resuming_fleet([breaks_at(3), VLLM], **settings) as (fleet, _, client):
            body = {**CHAT, **changes}
            stream = Stream(await client.post(PATHS["chat"], json=body, headers=headers))
            counted = await outcomes(client)
            why = await refusals(client)
    assert stream.status == 200
    assert [e["code"] for e in stream.errors] == ["stream_interrupted"]
    assert stream.done == 0
    assert [dispatches(w) for w in fleet] == [1, 0]
    assert counted == {("refused", "chat"): 1}
    assert why == {reason: 1}


async def test_a_worker_whose_engine_gives_no_ids_is_not_asked_and_not_resumed(
    vocabulary: str,
) -> None:
    sglang = FakeWorkerSettings(
        engine="sglang", fail_first=1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=3
    )
    with trio.fail_after(GUARD_S):
        async with resuming_fleet([sglang, VLLM], kv_tokenizer=vocabulary) as (_, _, client):
            stream = await post(client, "chat")
            why = await refusals(client)
    assert [e["code"] for e in stream.errors] == ["stream_interrupted"]
    assert why == {"no_ids": 1}


async def test_with_resume_off_nothing_is_asked_and_a_break_ends_as_before(
    vocabulary: str,
) -> None:
    with trio.fail_after(GUARD_S):
        async with resuming_fleet(
            [breaks_at(3), VLLM], kv_tokenizer=vocabulary, resume_limit=0
        ) as (fleet, _, client):
            stream = await post(client, "completions")
            counted = await outcomes(client)
    assert [e["code"] for e in stream.errors] == ["stream_interrupted"]
    assert stream.text == expected_text(3)
    assert [dispatches(w) for w in fleet] == [1, 0]
    assert counted == {}


async def test_pd_a_decode_broken_mid_stream_goes_on_through_a_new_pair(vocabulary: str) -> None:
    prefill = FakeWorkerSettings(engine="vllm", role="prefill", bootstrap_port=9101)
    decode = FakeWorkerSettings(engine="vllm", role="decode")
    broken_decode = breaks_at(4, role="decode")
    with trio.fail_after(GUARD_S):
        async with resuming_fleet([prefill, broken_decode, decode], kv_tokenizer=vocabulary) as (
            fleet,
            _,
            client,
        ):
            stream = await post(client, "chat")
            counted = await outcomes(client)
    assert_whole(stream)
    first_prefill, broken, good = fleet
    # Two pairs: the first decode broke, the continuation went to a new pair.
    assert (dispatches(first_prefill), dispatches(broken), dispatches(good)) == (2, 1, 1)
    rooms = [h["bootstrap_room"] for h in first_prefill.worker.routing.handoffs]
    assert len(set(rooms)) == 2
    assert counted == {("resumed", "chat"): 1}


async def test_pd_a_decode_worker_killed_mid_stream_completes_through_a_new_pair(
    vocabulary: str,
) -> None:
    """The decode serving the stream is a process of its own, SIGKILLed once the client has
    four events: the router sees its connection end, and the rest comes from the other
    prefill and the other decode."""
    prefills = [
        FakeWorkerSettings(engine="vllm", role="prefill", bootstrap_port=port)
        for port in (9101, 9102)
    ]
    decode = FakeWorkerSettings(engine="vllm", role="decode")
    killed_decode = (
        "fake-worker",
        "--port",
        "0",
        "--engine",
        "vllm",
        "--role",
        "decode",
        "--token-latency-ms",
        "50",
    )
    with trio.fail_after(GUARD_S):
        async with (
            open_cli_piped(*killed_decode) as (process, stdout, _),
            open_fake_fleet([*prefills, decode]) as fleet,
        ):
            doomed = await stdout.url(r"fake-worker listening on (http://\S+)")
            specs = [
                f"{doomed},model={MODEL},engine=vllm,role=decode",
                *(worker_spec(w) for w in fleet),
            ]
            async with (
                open_router(specs, policy="round_robin", kv_tokenizer=vocabulary) as router,
                httpx.AsyncClient(base_url=router.url, timeout=10) as client,
            ):
                seen = bytearray()
                async with client.stream("POST", PATHS["chat"], json=CHAT) as response:
                    assert response.headers["x-router-worker"] == doomed
                    async for chunk in response.aiter_raw():
                        seen += chunk
                        if process.returncode is None and seen.count(b"data: ") >= 4:
                            process.kill()
                            assert await process.wait() == -signal.SIGKILL
                    stream = Stream(httpx.Response(200, content=bytes(seen)))
                counted = await outcomes(client)
    assert_whole(stream)
    first_prefill, second_prefill, good_decode = fleet
    assert (dispatches(first_prefill), dispatches(second_prefill), dispatches(good_decode)) == (
        1,
        1,
        1,
    )
    rooms = [
        w.worker.routing.handoffs[0]["bootstrap_room"] for w in (first_prefill, second_prefill)
    ]
    assert rooms[0] != rooms[1]
    assert good_decode.worker.routing.handoffs[0]["bootstrap_room"] == rooms[1]
    assert counted == {("resumed", "chat"): 1}


async def test_a_broken_stream_leaves_nothing_for_the_cycle_collector(vocabulary: str) -> None:
    """How a stream broke is kept for the error event a later failure ends with: kept
    with its traceback, whose frames hold the request (and so the kept exception), every
    broken stream's buffers would wait for a full collection."""
    streams: list[Stream] = []
    gc.collect()
    gc.disable()
    try:
        with trio.fail_after(GUARD_S):
            for route, changes in (("completions", {}), ("chat", {"n": 2})):
                async with resuming_fleet([breaks_at(3), VLLM], kv_tokenizer=vocabulary) as (
                    _,
                    _,
                    client,
                ):
                    streams.append(await post(client, route, **changes))
            left = [o for o in gc.get_objects() if isinstance(o, StreamBroken)]
    finally:
        gc.enable()
    resumed, refused = streams
    assert_whole(resumed)
    assert [e["code"] for e in refused.errors] == ["stream_interrupted"]
    assert left == []


async def test_a_continuation_stays_on_its_model_and_never_falls_back(vocabulary: str) -> None:
    """A fallback takes requests a model cannot; never the rest of a stream another model
    began: its tokens are that model's. The model's other worker answers 503, so only the
    fallback is left untried."""
    wedged = FakeWorkerSettings(engine="vllm", fail_first=-1)
    other = FakeWorkerSettings(engine="vllm", model="other-model")
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet([breaks_at(3), wedged, other]) as fleet,
            open_router(
                [
                    *(worker_spec(w) for w in fleet[:2]),
                    f"{fleet[2].url},model=other-model,engine=vllm",
                ],
                policy="round_robin",
                kv_tokenizer=vocabulary,
                model_fallbacks=((MODEL, ("other-model",)),),
            ) as router,
            httpx.AsyncClient(base_url=router.url, timeout=10) as client,
        ):
            stream = await post(client, "chat")
            counted = await outcomes(client)
    assert [e["code"] for e in stream.errors] == ["stream_interrupted"]
    assert stream.text == expected_text(2)
    assert [dispatches(w) for w in fleet] == [1, 1, 0]
    assert counted == {("failed", "chat"): 1}

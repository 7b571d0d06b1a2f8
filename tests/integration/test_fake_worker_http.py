"""The fake worker over real loopback sockets: the real OpenAI client, each scripted failure
as a client sees it, the queue gauge under load, and disconnects."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from functools import partial

import httpx
import openai
import orjson
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from router.fake_worker.behaviour import FailMode
from router.fake_worker.formats import expected_text
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import FakeWorkerHandle, open_fake_fleet
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "say something"}]}


def _openai_calls(base_url: str) -> dict[str, object]:
    """Unary and streaming chat plus a completion, through the sync client (run in a thread)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=10)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "say something"}
    ]
    unary = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=7)
    stream = client.chat.completions.create(
        model="fake-model",
        messages=messages,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    completion = client.completions.create(model="fake-model", prompt="a b c d", max_tokens=3)
    assert unary.usage is not None and completion.usage is not None
    streamed_usage = chunks[-1].usage
    assert streamed_usage is not None
    return {
        "unary_text": unary.choices[0].message.content,
        "unary_usage": (unary.usage.prompt_tokens, unary.usage.completion_tokens),
        "stream_text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        "stream_finish": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
        "stream_usage": (streamed_usage.prompt_tokens, streamed_usage.completion_tokens),
        "completion_text": completion.choices[0].text,
        "completion_usage": completion.usage.completion_tokens,
    }


async def test_the_openai_client_parses_unary_and_streaming_answers() -> None:
    with trio.fail_after(30):
        async with open_fake_fleet(1) as fleet:
            result = await trio.to_thread.run_sync(_openai_calls, fleet[0].url)
            routing = fleet[0].worker.routing
            assert routing.dispatches == 3
            assert routing.paths["/v1/chat/completions"] == 2
            assert routing.paths["/v1/completions"] == 1
    assert result == {
        "unary_text": expected_text(7),
        "unary_usage": (2, 7),
        "stream_text": expected_text(5),
        "stream_finish": "length",
        "stream_usage": (2, 5),
        "completion_text": expected_text(3),
        "completion_usage": 3,
    }


def _failing(mode: FailMode, **fields: object) -> FakeWorkerSettings:
    fields = {"fail_first": 1, **fields}
    return FakeWorkerSettings(fail_mode=mode, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("status", "retry_after"), [(503, "1"), (429, "1"), (500, None)])
async def test_status_mode_answers_the_code_then_recovers(
    status: int, retry_after: str | None
) -> None:
    with trio.fail_after(10):
        async with open_fake_fleet([_failing(FailMode.STATUS, fail_status=status)]) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                failed = await client.post("/v1/chat/completions", json=CHAT)
                recovered = await client.post("/v1/chat/completions", json=CHAT)
    assert failed.status_code == status
    assert failed.headers.get("retry-after") == retry_after
    assert set(failed.json()["error"]) == {"message", "type", "code"}
    assert recovered.status_code == 200
    assert (fleet[0].worker.routing.dispatches, fleet[0].worker.routing.failures) == (2, 1)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


async def test_reset_mode_resets_the_tcp_connection() -> None:
    with trio.fail_after(10):
        async with open_fake_fleet([_failing(FailMode.RESET, fail_first=2)]) as fleet:
            # A bare socket sees the RST itself.
            sock = trio.socket.socket()
            with sock:
                await sock.connect(("127.0.0.1", fleet[0].port))
                body = orjson.dumps(CHAT)
                head = (
                    f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode()
                await sock.send(head + body)
                with pytest.raises(ConnectionResetError):
                    while await sock.recv(65536):
                        pass
            # And so does an HTTP client.
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                with pytest.raises(httpx.TransportError) as caught:
                    await client.post("/v1/chat/completions", json=CHAT)
                assert any(isinstance(e, ConnectionResetError) for e in _causes(caught.value))
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert fleet[0].worker.routing.failures == 2
    assert fleet[0].worker.routing.disconnects == 0


async def test_hang_mode_never_answers_and_the_leaving_client_is_counted() -> None:
    with trio.fail_after(10):
        async with open_fake_fleet([_failing(FailMode.HANG)]) as fleet:
            routing = fleet[0].worker.routing
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                with trio.move_on_after(0.5) as waited:
                    await client.post("/v1/chat/completions", json=CHAT)
                assert waited.cancelled_caught
                assert routing.inflight == 1
            # The cancelled request's connection closed: the worker notices within a second.
            with trio.fail_after(1):
                await wait_until(lambda: routing.disconnects == 1)
            assert routing.inflight == 0
            assert routing.failures == 1


async def test_garbage_mode_is_a_200_whose_body_is_not_json() -> None:
    with trio.fail_after(10):
        async with open_fake_fleet([_failing(FailMode.GARBAGE, fail_first=2)]) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                unary = await client.post("/v1/chat/completions", json=CHAT)
                stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert unary.status_code == 200
    with pytest.raises(ValueError):
        unary.json()
    assert stream.status_code == 200
    payloads = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    with pytest.raises(ValueError):
        orjson.loads(payloads[0])


async def test_midstream_mode_sends_k_chunks_then_breaks_without_done() -> None:
    settings = _failing(FailMode.MIDSTREAM, fail_after_chunks=4, token_latency_ms=1)
    received: list[str] = []
    with trio.fail_after(10):
        async with open_fake_fleet([settings]) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    body = {**CHAT, "stream": True}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                        assert resp.status_code == 200
                        async for line in resp.aiter_lines():
                            if line.startswith("data: "):
                                received.append(line[6:])
    assert len(received) == 4
    assert "[DONE]" not in received
    assert all(orjson.loads(event)["object"] == "chat.completion.chunk" for event in received)


def _gauge_sum(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def test_max_concurrency_queues_the_rest_and_the_gauge_shows_it() -> None:
    settings = FakeWorkerSettings(max_concurrency=1, ttft_ms=300, tokens=2)
    with trio.fail_after(20):
        async with open_fake_fleet([settings]) as fleet:
            worker = fleet[0].worker
            async with httpx.AsyncClient(base_url=fleet[0].url, timeout=10) as client:
                traffic = Traffic()
                send = partial(client.post, "/v1/chat/completions", json=CHAT)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(traffic.keep_sending, send, clients=3, most=1))
                    with trio.fail_after(5):
                        await wait_until(lambda: worker.routing.inflight == 3)
                    text = (await client.get("/metrics")).text
                    assert _gauge_sum(text, "sglang:num_running_reqs") == 1
                    assert _gauge_sum(text, "sglang:num_queue_reqs") == 2
                after = (await client.get("/metrics")).text
    assert traffic.statuses() == [200, 200, 200]
    assert _gauge_sum(after, "sglang:num_queue_reqs") == 0
    assert _gauge_sum(after, "sglang:num_running_reqs") == 0
    assert _gauge_sum(after, "sglang:generation_tokens_total") == 6


async def _open_stream(handle: FakeWorkerHandle) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", handle.port)
    body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 1000})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + body)
    return stream


async def test_a_client_leaving_mid_stream_is_counted_long_before_the_stream_would_end() -> None:
    settings = FakeWorkerSettings(token_latency_ms=10)
    with trio.fail_after(10):
        async with open_fake_fleet([settings]) as fleet:
            routing = fleet[0].worker.routing
            stream = await _open_stream(fleet[0])
            first = await stream.receive_some(65536)
            assert first.startswith(b"HTTP/1.1 200")
            # An abrupt close, as a killed client would leave it.
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            await stream.aclose()
            left_at = trio.current_time()
            # The stream would run 10 s (1000 tokens, 10 ms apart): noticed at the next
            # token, well within half of that even on a loaded machine.
            with trio.fail_after(5):
                await wait_until(lambda: routing.disconnects == 1)
            assert trio.current_time() - left_at < 5.0
            assert routing.inflight == 0
            assert fleet[0].worker.routing.loads[0].running == 0
            # It stopped generating: far fewer than the 1000 tokens asked for.
            assert fleet[0].worker.routing.loads[0].generation_tokens < 200


async def test_debug_behaviour_changes_a_live_worker() -> None:
    with trio.fail_after(10):
        async with open_fake_fleet(1) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                change = {"fail_first": 2, "fail_status": 500, "tokens": 3}
                updated = await client.post("/debug/behaviour", json=change)
                assert updated.status_code == 200
                assert updated.json()["fail_remaining"] == 2
                rejected = await client.post("/debug/behaviour", json={"fail_mood": "status"})
                assert rejected.status_code == 400
                codes = [
                    (await client.post("/v1/chat/completions", json=CHAT)).status_code
                    for _ in range(3)
                ]
                last = await client.post("/v1/chat/completions", json=CHAT)
                shown = (await client.get("/debug/behaviour")).json()
                routing = (await client.get("/debug/routing")).json()
                await client.post("/debug/reset")
                cleared = (await client.get("/debug/routing")).json()
    assert codes == [500, 500, 200]
    assert last.json()["choices"][0]["message"]["content"] == expected_text(3)
    assert shown["fail_first"] == 2 and shown["fail_remaining"] == 0 and shown["tokens"] == 3
    assert (routing["dispatches"], routing["failures"]) == (5, 2)
    assert "/debug/routing" not in routing["paths"]
    assert (cleared["dispatches"], cleared["failures"], cleared["paths"]) == (0, 0, {})

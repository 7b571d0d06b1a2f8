"""The fake gRPC engine's side port: the HTTP fake's `/debug/*` endpoints, the scripted
failures of its KV-event stream, and what it does with requests no test should send."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from router.fake_worker.grpc_engine import debug_http
from router.fake_worker.grpc_engine.debug_http import MAX_BODY, MAX_REQUEST, start_debug_server
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.grpc_engine import Served, run_scenario, serving


async def _exchange(port: int, raw: bytes) -> tuple[int, Any]:
    """Send `raw`, read the whole answer (the server closes), return status and JSON."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head
    return int(head.split()[1]), orjson.loads(body)


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


def _endless_headers() -> bytes:
    """A request whose headers alone are larger than any request may be."""
    header = b"x-filler: " + b"y" * 8000 + b"\r\n"
    return b"GET /health HTTP/1.1\r\n" + header * (MAX_REQUEST // len(header) + 2)


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def test_behaviour_routing_and_reset(tmp_path: Path) -> None:
    async def scenario() -> list[tuple[int, Any]]:
        async with serving(tmp_path, FakeWorkerSettings(model="m")) as served:
            server = await start_debug_server(served.engine, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                served.engine.routing.dispatches = 7
                return [
                    await _exchange(port, _post("/debug/behaviour", b'{"fail_first": 2}')),
                    await _exchange(port, _get("/debug/routing")),
                    await _exchange(port, _post("/debug/reset", b"")),
                    await _exchange(port, _get("/debug/behaviour")),
                    await _exchange(port, _get("/health")),
                ]
            finally:
                server.close()
                await server.wait_closed()

    behaviour, routing, reset, after, health = run_scenario(scenario)
    assert behaviour[0] == 200 and behaviour[1]["fail_remaining"] == 2
    assert routing[0] == 200 and routing[1]["dispatches"] == 7 and routing[1]["resets"] == 0
    assert reset == (200, reset[1]) and reset[1]["dispatches"] == 0
    assert after[1]["fail_first"] == 2
    assert health == (200, {"serving": True})


def test_bad_requests_get_clear_errors_and_change_nothing(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[tuple[int, Any]], int]:
        async with serving(tmp_path, FakeWorkerSettings(model="m")) as served:
            server = await start_debug_server(served.engine, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                answers = [
                    await _exchange(port, _post("/debug/behaviour", b"{not json")),
                    await _exchange(port, _post("/debug/behaviour", b'{"fail_first": "x"}')),
                    await _exchange(port, _post("/debug/behaviour", b'{"nope": 1}')),
                    await _exchange(port, _get("/nowhere")),
                    await _exchange(port, _post("/debug/routing", b"")),
                    await _exchange(port, b"GARBAGE / HTTP/9.9\r\n\r\n"),
                    await _exchange(port, _post("/debug/behaviour", b"x" * (MAX_BODY + 1))),
                    await _exchange(port, _endless_headers()),
                ]
            finally:
                server.close()
                await server.wait_closed()
            return answers, served.engine.behaviour.fail_first

    answers, fail_first = run_scenario(scenario)
    assert [status for status, _ in answers] == [400, 400, 400, 404, 405, 400, 413, 413]
    assert "not valid JSON" in answers[0][1]["error"]["message"]
    assert "fail_first" in answers[1][1]["error"]["message"]
    assert "unknown behaviour field" in answers[2][1]["error"]["message"]
    assert fail_first == 0


def test_a_client_that_never_finishes_its_request_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(debug_http, "READ_TIMEOUT_S", 0.05)

    async def scenario() -> bytes:
        async with serving(tmp_path, FakeWorkerSettings(model="m")) as served:
            server = await start_debug_server(served.engine, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /debug/rout")
                answer = await reader.read()
                writer.close()
                return answer
            finally:
                server.close()
                await server.wait_closed()

    assert run_scenario(scenario) == b""


def _kv_settings() -> FakeWorkerSettings:
    return FakeWorkerSettings(model="m", tokens=1, cache_tokens=1024, kv_events=True)


async def _subscribed(served: Served) -> Any:
    """A SubscribeKvEvents call the fake has taken (its headers come after)."""
    call = served.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    await call.initial_metadata()
    return call


async def _store(served: Served, first: int) -> None:
    """A generation whose prompt is one new block: one batch."""
    request = pb.GenerateRequest(
        request_id="kv", tokenized=pb.TokenizedInput(input_ids=[first] * 16)
    )
    [_ async for _ in served.stub.Generate(request)]


def test_scripted_data_loss_ends_every_live_subscription_and_a_new_one_serves(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[tuple[int, Any], list[Any], common_pb2.KvEventBatch]:
        async with serving(tmp_path, _kv_settings()) as served:
            server = await start_debug_server(served.engine, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                calls = [await _subscribed(served), await _subscribed(served)]
                answer = await _exchange(port, _post("/debug/kv_events/data_loss", b""))
                errors = []
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call.read()
                    errors.append(caught.value)
                # The subscriber's answer to DATA_LOSS: resubscribe from zero.
                again = await _subscribed(served)
                await _store(served, 5)
                batch = await again.read()
                again.cancel()
                return answer, errors, batch
            finally:
                server.close()
                await server.wait_closed()

    (status, counts), errors, batch = run_scenario(scenario)
    assert status == 200 and counts["ended"] == 2
    assert (counts["subscriptions_live"], counts["subscriptions_data_loss"]) == (0, 2)
    assert [(e.code(), e.details()) for e in errors] == [
        (grpc.StatusCode.DATA_LOSS, "scripted data loss")
    ] * 2
    assert batch.sequence_number == 0 and batch.events[0].WhichOneof("data") == "stored"


def test_a_scripted_skip_makes_the_next_batch_number_jump(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[tuple[int, Any]], list[int]]:
        async with serving(tmp_path, _kv_settings()) as served:
            server = await start_debug_server(served.engine, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                call = await _subscribed(served)
                await _store(served, 5)
                answers = [
                    await _exchange(port, _post("/debug/kv_events/skip", b'{"batches": 3}')),
                    await _exchange(port, _post("/debug/kv_events/skip", b'{"batches": 0}')),
                    await _exchange(port, _post("/debug/kv_events/skip", b"[3]")),
                ]
                await _store(served, 6)
                numbers = [(await call.read()).sequence_number for _ in range(2)]
                call.cancel()
                return answers, numbers
            finally:
                server.close()
                await server.wait_closed()

    (skipped, zero, malformed), numbers = run_scenario(scenario)
    assert skipped[0] == 200
    assert (skipped[1]["next_sequence"], skipped[1]["published"]) == (4, 1)
    assert [zero[0], malformed[0]] == [400, 400]
    assert numbers == [0, 4]


def test_the_kv_scripts_are_refused_without_kv_events(tmp_path: Path) -> None:
    async def scenario() -> list[tuple[int, Any]]:
        async with serving(tmp_path, FakeWorkerSettings(model="m")) as served:
            server = await start_debug_server(served.engine, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                return [
                    await _exchange(port, _post("/debug/kv_events/data_loss", b"")),
                    await _exchange(port, _post("/debug/kv_events/skip", b'{"batches": 1}')),
                    await _exchange(port, _get("/debug/routing")),
                ]
            finally:
                server.close()
                await server.wait_closed()

    loss, skip, routing = run_scenario(scenario)
    assert [loss[0], skip[0]] == [400, 400]
    assert "--kv-events" in loss[1]["error"]["message"]
    assert routing[1]["kv_events"] is None

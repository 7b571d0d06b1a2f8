"""The fake gRPC engine's side port: the HTTP fake's `/debug/*` endpoints, and what it
does with requests no test should send."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.fake_worker.grpc_engine import debug_http
from router.fake_worker.grpc_engine.debug_http import MAX_BODY, MAX_REQUEST, start_debug_server
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.grpc_engine import run_scenario, serving


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

"""The SGLang Model Gateway (`smg`, the Rust plane) in front of two in-process fake workers:
it admits them as SGLang engines and round-robins chat requests across them."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from router.fake_worker.formats import expected_text
from tests.support.fake_fleet import open_fake_fleet
from tests.support.ports import free_port
from tests.support.smg_process import smg_command, stop_smg

pytestmark = pytest.mark.smg

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@asynccontextmanager
async def open_smg(worker_urls: list[str], log_path: Path) -> AsyncIterator[str]:
    """Launch smg in front of `worker_urls`; yield its URL once it has admitted all of them."""
    port, metrics_port = free_port(), free_port()
    command = smg_command("--worker-urls", *worker_urls, port=port, metrics_port=metrics_port)
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            with trio.fail_after(60):
                while not await _admitted(client, len(worker_urls)):
                    if process.returncode is not None:
                        log_tail = (await trio.Path(log_path).read_text())[-2000:]
                        raise AssertionError(f"smg exited early: {log_tail}")
                    await trio.sleep(0.1)
        yield url
    finally:
        await stop_smg(process)


async def _admitted(client: httpx.AsyncClient, count: int) -> bool:
    try:
        response = await client.get("/readiness")
    except httpx.TransportError:
        return False
    return response.status_code == 200 and response.json().get("healthy_workers") == count


def _stream_text(body: str) -> tuple[str, bool]:
    """The concatenated delta content of an OpenAI SSE body, and whether it ended in [DONE]."""
    payloads = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    text = ""
    for payload in payloads[:-1]:
        for choice in orjson.loads(payload)["choices"]:
            text += choice["delta"].get("content") or ""
    return text, payloads[-1] == "[DONE]"


async def test_smg_admits_fake_workers_and_round_robins_across_them(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with open_fake_fleet(2) as fleet:
            urls = [handle.url for handle in fleet]
            async with open_smg(urls, tmp_path / "smg.log") as gateway:
                admission = [dict(handle.worker.routing.paths) for handle in fleet]
                for handle in fleet:
                    handle.worker.routing.reset()
                async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
                    unary = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(5)]
                    streamed = [
                        await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
                        for _ in range(5)
                    ]
                dispatches = [handle.worker.routing.dispatches for handle in fleet]
                ranks = [handle.worker.routing.ranks for handle in fleet]
    # Admission: smg waits for /health and /v1/models to answer 200 on each worker.
    for paths in admission:
        assert paths.get("/health", 0) >= 1
        assert paths.get("/v1/models", 0) >= 1
    assert [r.status_code for r in unary + streamed] == [200] * 10
    for response in unary:
        assert response.json()["choices"][0]["message"]["content"] == expected_text(4)
        assert response.json()["usage"]["completion_tokens"] == 4
    for response in streamed:
        assert _stream_text(response.text) == (expected_text(4), True)
    assert dispatches == [5, 5]
    assert ranks == [{}, {}]  # dp_size 1: smg sends no X-Data-Parallel-Rank

"""`router fake-worker` as a user runs it: a subprocess, its printed URL, its exit status."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest
import trio
import zmq

from router.engines.zmq_trio import close_socket, recv_multipart, socket_fd
from tests.support.cli_process import REPO, read_line, run_cli


async def _start(*args: str) -> trio.Process:
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "router.cli", "fake-worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )


async def _read_all(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


@pytest.mark.parametrize("stop_with", [signal.SIGTERM, signal.SIGINT])
async def test_it_prints_its_url_serves_and_exits_cleanly_on_a_signal(
    stop_with: signal.Signals,
) -> None:
    process = await _start("--port", "0", "--model", "cli-model", "--tokens", "3")
    try:
        assert process.stdout is not None and process.stderr is not None
        with trio.fail_after(20):
            line = await read_line(process.stdout)
            prefix = "fake-worker listening on http://127.0.0.1:"
            assert line.startswith(prefix) and line.endswith("\n")
            url = line.split()[-1]
            assert int(url.rsplit(":", 1)[1]) > 0
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/health")).status_code == 200
                models = (await client.get("/v1/models")).json()
                body = {"model": "cli-model", "messages": [{"role": "user", "content": "hi"}]}
                answer = (await client.post("/v1/chat/completions", json=body)).json()
            assert [m["id"] for m in models["data"]] == ["cli-model"]
            assert answer["usage"]["completion_tokens"] == 3
            process.send_signal(stop_with)
            assert await process.wait() == 0
            assert await _read_all(process.stderr) == b""
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_port_that_cannot_be_bound_exits_3_with_a_clear_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await _start("--port", str(port))
        try:
            assert process.stdout is not None and process.stderr is not None
            with trio.fail_after(20):
                stderr = (await _read_all(process.stderr)).decode()
                assert await process.wait() == 3
                assert await _read_all(process.stdout) == b""
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert f"cannot listen on 127.0.0.1:{port}" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--pd-protocol", "mooncak"], "invalid choice: 'mooncak'"),
        (["--fail-mode", "explode"], "invalid choice: 'explode'"),
        (["--dp-size", "0"], "dp_size must be >= 1"),
        (["--tokenizer", "/nonexistent/model"], "tokenizer needs a prefix cache"),
        (
            ["--cache-tokens", "64", "--tokenizer", "/nonexistent/model"],
            "tokenizer /nonexistent/model: no such file or directory",
        ),
    ],
)
async def test_bad_arguments_fail_at_parsing_with_status_2(args: list[str], complaint: str) -> None:
    with trio.fail_after(20):
        result = await run_cli("fake-worker", *args)
    assert result.returncode == 2
    assert complaint in result.stderr.decode()
    assert result.stdout == b""


async def test_kv_events_bind_ports_the_kernel_picks_and_the_listing_names_them(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Two fakes with `--kv-events` on one host: each binds two ports of its own (no
    collision is possible), prints them, and `/kv_event_sources` lists exactly those; the
    listed replay socket is the live one: it replays the batch of a request just served."""
    args = ("--engine", "vllm", "--cache-tokens", "1024", "--kv-events")
    processes = [await _start(*args), await _start(*args)]
    ports: list[int] = []
    try:
        for process in processes:
            assert process.stdout is not None
            with trio.fail_after(20):
                published = (await read_line(process.stdout)).split()
                url = (await read_line(process.stdout)).split()[-1]
            pub, replay = published[5].rstrip(","), published[-1]
            async with httpx.AsyncClient(base_url=url) as client:
                listing = (await client.get("/kv_event_sources")).json()
                assert listing["0"]["endpoint"] == pub
                assert listing["0"]["replay_endpoint"] == replay
                body = {"model": "fake-model", "prompt": list(range(100, 132)), "max_tokens": 1}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            ports += [int(pub.rsplit(":", 1)[1]), int(replay.rsplit(":", 1)[1])]
            dealer = zmq_context.socket(zmq.DEALER)
            try:
                dealer.connect(replay)
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                with trio.fail_after(10):
                    first = await recv_multipart(dealer, socket_fd(dealer))
                    end = await recv_multipart(dealer, socket_fd(dealer))
            finally:
                close_socket(dealer)
            # Framed as vLLM 0.32 frames a replay: (b"", topic, seq, payload).
            assert first[:3] == [b"", b"", (0).to_bytes(8, "big")] and b"BlockStored" in first[3]
            assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    finally:
        for process in processes:
            process.kill()
            await process.wait()
    assert len(set(ports)) == 4 and 0 not in ports

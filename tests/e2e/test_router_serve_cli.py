"""`router serve` as an operator runs it: a subprocess in front of a fake-worker subprocess,
stopped with SIGTERM while a stream is in flight, and its exit statuses."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.cli_process import open_cli_piped, run_cli

TOKENS = 100
TOKEN_LATENCY_MS = 20  # the stream lasts about two seconds


async def _wait_refused(port: int) -> None:
    """Return once a connection to `port` is refused. The signal is logged a moment
    before the server closes its listener, so a connection may still get in first."""
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        await stream.aclose()
        await trio.sleep(0.01)


async def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0() -> None:
    with trio.fail_after(30):
        async with open_cli_piped(
            "fake-worker",
            "--port",
            "0",
            "--tokens",
            str(TOKENS),
            "--token-latency-ms",
            str(TOKEN_LATENCY_MS),
        ) as (worker, worker_out, _):
            worker_url = await worker_out.url(r"^fake-worker listening on (http://\S+)$")
            async with open_cli_piped(
                "serve", "--port", "0", "--worker", worker_url, "--shutdown-grace-s", "60"
            ) as (router, _, router_err):
                router_url = await router_err.url(
                    r"router listening on (http://\S+) with 1 workers"
                )
                body = {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                }
                async with (
                    httpx.AsyncClient(base_url=router_url, timeout=10) as client,
                    client.stream("POST", "/v1/chat/completions", json=body) as stream,
                ):
                    assert stream.status_code == 200
                    assert stream.headers["x-router-worker"] == worker_url
                    chunks = stream.aiter_raw()
                    received = [await anext(chunks)]
                    router.send_signal(signal.SIGTERM)
                    await router_err.wait_for(r"SIGTERM: no new connections")
                    # The listener closes at once: nobody new gets in while the stream goes on.
                    with trio.fail_after(1):
                        await _wait_refused(int(router_url.rsplit(":", 1)[1]))
                    received += [chunk async for chunk in chunks]
                stream_done = trio.current_time()
                # Grace is 60 s: exiting now means the router left as soon as it drained.
                assert await router.wait() == 0
                assert trio.current_time() - stream_done < 5
            text = b"".join(received).decode()
            async with httpx.AsyncClient(base_url=worker_url) as client:
                routing = (await client.get("/debug/routing")).json()
            worker.send_signal(signal.SIGTERM)
            assert await worker.wait() == 0
    assert text.endswith("data: [DONE]\n\n")
    assert "event: error" not in text
    assert text.count("data: {") >= TOKENS  # every token arrived, none cut off
    assert (routing["dispatches"], routing["disconnects"]) == (1, 0)
    assert "router stopped" in router_err.text
    assert "Traceback" not in router_err.text


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--port", "abc"], "router serve: --port must be an integer, got 'abc'"),
        (["--policy", "fastest"], "router serve: --policy must be one of round_robin, random, "),
        (
            ["--worker", "localhost:8000"],
            "router serve: --worker 'localhost:8000': worker URL 'localhost:8000' must start with http://",
        ),
        (
            ["--worker", "http://127.0.0.1:1,model=m", "--worker", "https://gpu-7:8000,model=m"],
            "router serve: --worker 'https://gpu-7:8000,model=m': worker URL 'https://gpu-7:8000': "
            "TLS to workers is not supported",
        ),
        (
            ["--worker", "http://gpü-7:8000"],
            "router serve: --worker 'http://gpü-7:8000': worker URL 'http://gpü-7:8000' must be ASCII",
        ),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (
            ["--model-fallback", "big=small", "--model-fallback", "small=big"],
            "router serve: model names: model fallbacks loop: big -> small -> big",
        ),
        (
            ["--model-alias", "chat=v1", "--model-alias", "v1=chat"],
            "router serve: model names: alias 'chat' names the alias 'v1'",
        ),
        (
            ["--priority-classes", "interactive,batch", "--default-priority", "urgent"],
            "router serve: traffic policy: the default priority 'urgent' is not one of the "
            "classes (interactive, batch)",
        ),
    ],
)
async def test_a_bad_flag_exits_2_with_a_clear_message(args: list[str], complaint: str) -> None:
    with trio.fail_after(20):
        result = await run_cli("serve", *args)
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert complaint in stderr
    assert "Traceback" not in stderr
    assert result.stdout == b""


async def test_a_port_already_bound_exits_3() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(20):
            result = await run_cli("serve", "--port", str(port))
    stderr = result.stderr.decode()
    assert result.returncode == 3
    assert f"router serve: cannot listen on 127.0.0.1:{port}: " in stderr
    assert "Traceback" not in stderr


async def test_a_key_granted_a_class_that_does_not_exist_stops_the_start(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("nightly: {key: key-of-nightly, priority: urgent}\n")
    keys.chmod(0o600)
    with trio.fail_after(20):
        result = await run_cli(
            "serve",
            "--api-keys-file",
            str(keys),
            "--priority-classes",
            "interactive,batch",
            "--default-priority",
            "interactive",
        )
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert f"router serve: keys file {keys}: 'nightly': 'urgent' is not a priority class" in stderr
    assert "key-of-nightly" not in stderr
    assert "Traceback" not in stderr

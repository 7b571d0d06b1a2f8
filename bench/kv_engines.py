"""`python -m bench --kv-engines`: `kv_aware` against other policies in front of three
real vLLM engines (the CPU build, `make engine-env`), judged by the engines' own counters.

Two fleets in turn, "evicting" (`EVICTING_BLOCKS` blocks of cache per engine) and "roomy"
(the 1 GiB default), each engine publishing KV events over ZMQ with a replay socket. On
each, every contender in turn is started, the engines' caches flushed, the multi-turn
workload of `bench.cache_workload` played and the contender stopped: the policies side
by side, ours with `--processes 2`, and ours restarted mid-run (the engines keep their
caches)."""

from __future__ import annotations

import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import httpx
import orjson
import trio

from bench import kv_engines_report as kv_report
from bench.cache import TUNED
from bench.cache_workload import CHAT_PATH, ClientStats, Workload, converse, play
from bench.kv_engines_report import FleetCounters, FleetShape, KvRun, RestartRun, Window
from bench.procs import BenchError, Proc, free_port, python_module, start
from bench.run import Log, dump_json, machine, versions
from conformance import engines
from conformance.engines import EngineEnvironment

MODEL = "tiny"
ENGINES = 3
BLOCK_SIZE = 32  # the CPU attention backend takes only multiples of 32
# vLLM refuses a cache smaller than one longest request (max_model_len / block_size
# blocks); the workload's longest prompt is about 850 tokens (measured with /tokenize).
MAX_MODEL_LEN = 1024
# The fleet then holds 120 blocks, 28% of the workload's 433 distinct ones (the run says),
# about the six conversations in flight at once: every engine evicts what it will need
# again. At 64 blocks a policy spreading over all three engines lost nothing to eviction.
EVICTING_BLOCKS = 40
SCENARIOS = (("evicting", EVICTING_BLOCKS), ("roomy", None))
# 6 clients on 3 engines: the cache_aware load check at 4 is twice the mean load, as in
# `bench --cache` (bench/cache.py, TUNED).
WORKLOAD = Workload(conversations=24, turns=6, users=6, system_chars=600, user_chars=200)
QUICK_WORKLOAD = Workload(conversations=12, turns=4, users=6, system_chars=600, user_chars=200)
REQUEST_TIMEOUT_S = 120.0
ENGINE_DEV_ENV = {**engines.ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"}  # serves /reset_prefix_cache
HI = [{"role": "user", "content": "hi"}]
PROBE = orjson.dumps({"model": MODEL, "messages": HI, "max_tokens": 1})
JSON = {"content-type": "application/json"}
SETTLE_S = 0.5  # for the engines' counters and events to catch up after the last request


@dataclass(frozen=True, slots=True)
class KvContender:
    name: str  # "ours ..." or "smg ..."
    policy: str
    flags: tuple[str, ...] = ()
    processes: int = 1
    replicas: int = 1
    """Independent router processes, each on its own port, the clients split between them."""
    idle_replicas: int = 0
    """Of the `replicas`, how many get no clients: they run beside the others (their event
    subscriptions and load reads) and decide nothing."""
    kv_tokenizer: bool = True
    """kv_aware with `--kv-tokenizer` the model's directory; False: as an operator starts
    it, the router finds its token ids itself (`--kv-token-sources`)."""


SIDE_BY_SIDE = (
    KvContender("ours kv_aware", "kv_aware"),
    KvContender("ours cache_aware", "cache_aware", TUNED),
    KvContender("ours round_robin", "round_robin"),
    KvContender("smg cache_aware", "cache_aware", TUNED),
)
TWO_PROCESSES = (
    KvContender("ours kv_aware (--processes 2)", "kv_aware", processes=2),
    KvContender("ours cache_aware (--processes 2)", "cache_aware", TUNED, processes=2),
)
REPLICAS = (
    KvContender("ours kv_aware (2 routers)", "kv_aware", replicas=2),
    KvContender("ours cache_aware (2 routers)", "cache_aware", TUNED, replicas=2),
)
NO_FLAG = (
    KvContender("ours kv_aware (no --kv-tokenizer)", "kv_aware", kv_tokenizer=False),
    KvContender(
        "ours kv_aware (engine /tokenize)",
        "kv_aware",
        ("--kv-token-sources", "engine"),
        kv_tokenizer=False,
    ),
)
OWN_LOAD = (
    KvContender("ours kv_aware (own count)", "kv_aware", ("--engine-load-interval-s", "0")),
    KvContender(
        "ours kv_aware (--processes 2, own count)",
        "kv_aware",
        ("--engine-load-interval-s", "0"),
        processes=2,
    ),
)
"""Each process counting only its own requests, not reading the engines' load: beside
`side` and `two`, what reading the load changes."""
MARGINS = (
    KvContender("ours kv_aware", "kv_aware"),
    KvContender("ours kv_aware (2 routers)", "kv_aware", replicas=2),
    KvContender(
        "ours kv_aware (2 routers, margin 0)", "kv_aware", ("--spread-margin", "0"), replicas=2
    ),
)
"""`kv_aware` alone, one process against two independent routers at the default spread
margin (0.5) and at none: the replicas' figure with less of the machine's time."""
CONTROL = (
    KvContender("ours kv_aware", "kv_aware"),
    KvContender("ours kv_aware (2 routers)", "kv_aware", replicas=2),
    KvContender(
        "ours kv_aware (1 router, 1 idle beside it)", "kv_aware", replicas=2, idle_replicas=1
    ),
)
"""`kv_aware` alone: one process, two routers sharing the clients, and the control: two
routers of which one gets every client, so one decides and the machine carries the
second's background work (what two routers cost the engines, without two deciders)."""
LOAD_SOURCES = (
    KvContender("ours kv_aware", "kv_aware"),
    KvContender("ours kv_aware (2 routers)", "kv_aware", replicas=2),
    KvContender(
        "ours kv_aware (2 routers, /metrics only)",
        "kv_aware",
        ("--engine-server-load-interval-s", "0"),
        replicas=2,
    ),
)
"""`kv_aware` alone, one process against two independent routers reading each engine's
`/load` (the default) and reading only its `/metrics`, as before `/load` was read."""
RESTARTED = SIDE_BY_SIDE[:2]
GROUPS = {
    "side": SIDE_BY_SIDE,
    "two": TWO_PROCESSES,
    "replicas": REPLICAS,
    "noflag": NO_FLAG,
    "ownload": OWN_LOAD,
    "margins": MARGINS,
    "loadsource": LOAD_SOURCES,
    "control": CONTROL,
}
ALL_GROUPS = ("side", "two", "replicas", "noflag", "ownload", "restart")
"""What runs by default; `margins`, `loadsource` and `control` only when named."""


def log_name(contender: str) -> str:
    """A contender's name as a file name: "ours kv_aware (engine /tokenize)" is
    "ours-kv_aware-engine-tokenize" (a slash in it would name a directory)."""
    return "-".join(re.findall(r"[A-Za-z0-9_.]+", contender))


def run(
    out: Path,
    quick: bool,
    log: Log,
    command: str,
    *,
    scenarios: Sequence[str] = ("evicting", "roomy"),
    groups: Sequence[str] = ALL_GROUPS,
    repeat: int = 1,
    block: str | None = None,
) -> int:
    """The fleets of `scenarios`, the contenders of `groups` (`repeat` times over, in
    turn, so the runs of one contender interleave with the others'); the exit status (2
    without the engine environment). The figures replace the main block of `out` and its
    JSON, or with `block` a block and JSON of that name, the main one kept."""
    start_marker, end_marker = kv_report.markers(block)
    try:
        environment = EngineEnvironment.from_env()
    except engines.EngineUnavailable as exc:
        log(f"python -m bench --kv-engines: {exc}")
        return 2
    workload = QUICK_WORKLOAD if quick else WORKLOAD
    # A SIGTERM (a `timeout`, a cancelled job) unwinds as Ctrl-C does: every engine stops.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    header = {**machine(), **versions(), "command": command}
    runs: list[KvRun] = []
    restarts: list[RestartRun] = []
    facts: dict[str, float] = {}
    failure: BaseException | None = None
    with tempfile.TemporaryDirectory(prefix="bench-kv-engines-") as work:
        try:
            for scenario, blocks in SCENARIOS:
                if scenario not in scenarios:
                    continue
                with open_engine_fleet(environment, blocks, Path(work), log) as urls:
                    facts = facts or workload_facts(urls[0], workload, log)
                    bench = KvBench(scenario, urls, Path(work), environment.model_dir, log)
                    contenders = [c for group in groups if group in GROUPS for c in GROUPS[group]]
                    for _ in range(repeat):
                        for contender in contenders:
                            runs.append(bench.measure(contender, workload))
                    if "restart" in groups:
                        for contender in RESTARTED:
                            restarts.append(bench.measure_restart(contender, workload))
        except* (BenchError, kv_report.MetricsError, httpx.HTTPError, trio.TooSlowError) as group:
            failure = group
    while isinstance(failure, BaseExceptionGroup):  # the first cause, out of trio's groups
        failure = failure.exceptions[0]
    if failure is not None:
        log(f"python -m bench --kv-engines: {failure!r}")
        if not runs and not restarts:
            return 1
        # What was measured before the failure is kept, said to be partial.
        header["partial"] = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
    wall = time.monotonic() - started
    model = environment.model_dir.name
    shape = FleetShape(ENGINES, BLOCK_SIZE, MAX_MODEL_LEN, EVICTING_BLOCKS, TUNED, model)
    header |= kv_report.describe(shape, workload, facts, wall)
    text = kv_report.markdown(runs, restarts, header, "evicting", "roomy", block=block)
    page = out.read_text() if out.exists() else ""
    out.write_text(kv_report.place_block(page, text, start_marker, end_marker))
    json_path = out.with_name(out.stem + "-kv-engines" + (f"-{block}" if block else "") + ".json")
    raw: dict[str, object] = {"header": header, "workload": asdict(workload), "facts": facts}
    raw |= {"runs": [asdict(one) for one in runs], "restarts": [asdict(r) for r in restarts]}
    dump_json(json_path, raw)
    log(f"wrote {out} and {json_path.name} ({wall / 60:.1f} min)")
    return 0 if failure is None else 1


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (`free_port` holds none, so it may repeat one)."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def engine_settings(blocks: int | None, pub: int, replay: int) -> engines.EngineSettings:
    """One engine's settings: KV events on ports `pub` and `replay`, `blocks` of cache."""
    # A `*` host makes the engine bind its sockets; without one it connects.
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}
    events["replay_endpoint"] = f"tcp://*:{replay}"
    extra = ["--block-size", str(BLOCK_SIZE), "--enable-prefix-caching"]
    extra += ["--max-model-len", str(MAX_MODEL_LEN)]
    extra += ["--kv-events-config", orjson.dumps(events).decode()]
    # Greedy answers: every contender plays the same conversations.
    extra += ["--override-generation-config", '{"temperature": 0.0}']
    # `/load` counts the requests the API server holds (read by the router's load reader).
    extra += ["--enable-server-load-tracking"]
    if blocks is not None:
        extra += ["--num-gpu-blocks-override", str(blocks)]
    return engines.EngineSettings(served_model_name=MODEL, extra_args=extra)


@contextmanager
def open_engine_fleet(
    environment: EngineEnvironment, blocks: int | None, work: Path, log: Log
) -> Iterator[list[str]]:
    """Start `ENGINES` engines at once, each in a process group of its own, and yield their
    URLs once every one answers a chat request. Every group is stopped on the way out,
    whatever the way (an error, Ctrl-C)."""
    procs: list[Proc] = []
    urls: list[str] = []
    try:
        ports = free_ports(3 * ENGINES)
        for index in range(ENGINES):
            port, pub, replay = ports[3 * index : 3 * index + 3]
            command = engines.engine_argv(environment, engine_settings(blocks, pub, replay), port)
            name = f"engine{index}-{blocks or 'roomy'}"
            procs.append(start(name, command, work, ENGINE_DEV_ENV, own_group=True))
            urls.append(f"http://127.0.0.1:{port}")
        log(f"starting {ENGINES} engines ({blocks or 'default'} blocks): 35-200 s each")
        started = time.monotonic()
        for proc, url in zip(procs, urls, strict=True):
            left = engines.READY_TIMEOUT_S - (time.monotonic() - started)
            proc.wait_for_answer(url + CHAT_PATH, PROBE, timeout_s=max(left, 1.0))
            log(f"  {proc.name} ready on {url} after {time.monotonic() - started:.0f} s")
        for url in urls:
            log(f"  {url}/kv_event_sources: {httpx.get(url + '/kv_event_sources').json()}")
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def workload_facts(url: str, workload: Workload, log: Log) -> dict[str, float]:
    """The workload in the engine's tokens (`POST /tokenize`, chat template applied): chars
    per token, the longest prompt, the distinct full blocks of every conversation's last
    prompt (which holds its earlier ones; each answer stood in by 8 letters)."""
    system = workload.system_prompt()
    prompts = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        body = {"model": MODEL, "prompt": system, "add_special_tokens": False}
        count = client.post("/tokenize", json=body).raise_for_status().json()["count"]
        for conversation in range(workload.conversations):
            messages = [{"role": "system", "content": system}]
            for turn in range(workload.turns):
                messages += [{"role": "user", "content": workload.user_message(conversation, turn)}]
                messages += [{"role": "assistant", "content": "abcdefgh"}]
            body = {"model": MODEL, "messages": messages[:-1]}
            prompts.append(client.post("/tokenize", json=body).raise_for_status().json()["tokens"])
    facts = kv_report.prompt_facts(prompts, BLOCK_SIZE) | {"chars_per_token": len(system) / count}
    log(f"workload: {facts}")
    if facts["longest_prompt_tokens"] + 2 * workload.answer_tokens > MAX_MODEL_LEN:
        raise BenchError(f"the longest prompt leaves no room under {MAX_MODEL_LEN} tokens")
    return facts


@dataclass
class KvBench:
    """One fleet's runs: contenders started in front of `urls`, one at a time."""

    scenario: str
    urls: list[str]
    work: Path
    model_dir: Path
    log: Log

    def measure(self, contender: KvContender, workload: Workload) -> KvRun:
        """Flush, play the whole workload through `contender`, read the engines."""
        ports = free_ports(contender.replicas)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        procs: list[Proc] = []
        try:
            for port in ports:
                procs.append(self.start_router(contender, port))
            url = urls[0]
            before = self.flush(contender, url)
            self.log(f"{self.scenario}: {contender.name}: {workload.requests} requests")
            started = time.perf_counter()
            deciding = urls[: len(urls) - contender.idle_replicas]
            stats = trio.run(
                partial(play, deciding, workload, model=MODEL, timeout_s=REQUEST_TIMEOUT_S)
            )
            wall = time.perf_counter() - started
            time.sleep(SETTLE_S)
            window = Window.between(before, self.counters())
            series = router_series(url) if contender.policy == "kv_aware" else {}
        finally:
            for proc in procs:
                proc.stop()
        one = KvRun.of(self.scenario, contender.name, stats, window, wall, series)
        self.log(one.summary())
        return one

    def measure_restart(self, contender: KvContender, workload: Workload) -> RestartRun:
        """The workload with the router stopped and started again (same flags and port)
        halfway; the engines read at `window` requests either side of the restart."""
        window = min(50, workload.requests * 2 // 5)
        restart_at = (workload.requests - 2 * window) // 2 + window
        points = (restart_at - window, restart_at, restart_at + window)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        routers = [self.start_router(contender, port)]
        readings: dict[int, tuple[FleetCounters, int]] = {}
        stats, took = ClientStats(), [0.0]

        def pause(sent: int) -> None:
            time.sleep(SETTLE_S)
            readings[sent] = (self.counters(), stats.errors)
            if sent == restart_at:
                began = time.monotonic()
                routers[-1].stop()
                routers.append(self.start_router(contender, port))
                took[0] = time.monotonic() - began

        try:
            self.flush(contender, url)
            self.log(f"{self.scenario}: {contender.name}, restarted after {restart_at} requests")
            trio.run(play_paused, url, workload, stats, points, pause)
            time.sleep(SETTLE_S)
            series = router_series(url) if contender.policy == "kv_aware" else {}
        finally:
            routers[-1].stop()
        marks = [readings[point] for point in points]
        one = RestartRun.of(self.scenario, contender.name, stats, window, marks, took[0], series)
        self.log(one.summary())
        return one

    def start_router(self, contender: KvContender, port: int) -> Proc:
        """`contender` on `port`, once it answers a chat request (and, for kv_aware, once
        it subscribes to every engine)."""
        workers = [arg for url in self.urls for arg in ("--worker", url)]
        flags = [*contender.flags, "--processes", str(contender.processes)]
        if contender.policy == "kv_aware" and contender.kv_tokenizer:
            flags += ["--kv-tokenizer", str(self.model_dir)]
        if contender.name.startswith("ours"):
            command = python_module("router.cli", "serve", "--port", str(port))
            command += ["--log-level", "warning", "--policy", contender.policy, *workers, *flags]
        else:  # smg as bench/cache.py starts it
            command = python_module("smg", "launch", "--worker-urls", *self.urls)
            command += ["--policy", contender.policy, "--log-level", "warn", "--host", "127.0.0.1"]
            command += ["--port", str(port), "--prometheus-host", "127.0.0.1"]
            prometheus = next(other for other in free_ports(2) if other != port)
            command += ["--prometheus-port", str(prometheus), *contender.flags]
        proc = start(f"{self.scenario}-{log_name(contender.name)}", command, self.work)
        url = f"http://127.0.0.1:{port}"
        try:
            proc.wait_for_answer(url + CHAT_PATH, PROBE, 60.0)
            if contender.policy == "kv_aware":
                # It subscribes once it knows the engine's kind, and a vLLM in development
                # mode may first answer /server_info past the router's 2 s (seen: 5.6 s).
                waited = wait_subscribed(url, len(self.urls), 180.0)
                self.log(f"  {contender.name} subscribed to every engine after {waited:.0f} s")
        except BaseException:
            proc.stop()
            raise
        return proc

    def flush(self, contender: KvContender, url: str) -> FleetCounters:
        """Empty every engine's prefix cache; the counters from which the run is read."""
        key = "router_kv_events_received_total{type=AllBlocksCleared}"
        watch = (
            contender.policy == "kv_aware" and contender.processes == 1 and contender.replicas == 1
        )
        wanted = (router_series(url).get(key, 0) if watch else 0) + len(self.urls)
        with httpx.Client(timeout=30.0) as client:
            for engine in self.urls:
                got = client.post(engine + "/reset_prefix_cache")
                if got.status_code != 200 or got.json().get("success") is False:
                    raise BenchError(f"{engine}/reset_prefix_cache: {got.status_code} {got.text}")
                # An engine publishes events when it steps: a request shorter than a block, so
                # that subscribers see the clear now rather than with the run's first request.
                client.post(engine + CHAT_PATH, content=PROBE, headers=JSON).raise_for_status()
        deadline = time.monotonic() + 10.0  # for the router to see every engine's flush
        while watch and (seen := router_series(url).get(key, 0)) < wanted:
            if time.monotonic() > deadline:
                self.log(f"  ! the router saw {seen:g} AllBlocksCleared in all, wanted {wanted:g}")
                break
            time.sleep(0.1)
        time.sleep(SETTLE_S)
        return self.counters()

    def counters(self) -> FleetCounters:
        with httpx.Client(timeout=10.0) as client:
            pages = [
                (url, client.get(url + "/metrics").raise_for_status().text) for url in self.urls
            ]
        return FleetCounters.parse(pages)


def router_series(url: str) -> dict[str, float]:
    """The router's `router_kv_*` and engine-load-read samples (one process's, under
    `--processes`)."""
    response = httpx.get(url + "/metrics", timeout=5.0, headers={"connection": "close"})
    if not response.is_success:
        return {}
    series = kv_report.labelled_series(response.text, "router_kv_")
    return series | kv_report.labelled_series(response.text, kv_report.LOAD_READS)


def wait_subscribed(url: str, engines: int, timeout_s: float) -> float:
    """Until the router runs a subscription per engine on 6 scrapes in a row (on fresh
    connections: under `--processes`, likely each process); the seconds it took."""
    deadline = (started := time.monotonic()) + timeout_s
    in_a_row = 0
    while in_a_row < 6:
        running = router_series(url).get("router_kv_events_subscriptions", 0)
        in_a_row = in_a_row + 1 if running >= engines else 0
        if time.monotonic() > deadline:
            raise BenchError(f"{url}: {running:g} KV-event subscriptions, wanted {engines}")
        time.sleep(0.1)
    return time.monotonic() - started


async def play_paused(
    url: str,
    workload: Workload,
    stats: ClientStats,
    points: Sequence[int],
    pause: Callable[[int], None],
) -> None:
    """`play`, held at each count in `points` of requests sent until those in flight are
    done, while `pause(count)` runs in a thread (a restart, a reading of the counters)."""

    gate = _Gate(stats, points, pause)
    system = workload.system_prompt()
    queue = list(range(workload.conversations))
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, transport=gate) as client:

        async def user() -> None:
            while queue:
                await converse(client, workload, system, queue.pop(0), stats, MODEL)

        async with trio.open_nursery() as nursery:
            for _ in range(workload.users):
                nursery.start_soon(user)


class _Gate(httpx.AsyncBaseTransport):
    """A transport that, at each count in `points` of requests sent, holds the next one
    until every one sent has ended (an answer or an error, in `stats`), runs the pause in
    a thread, then goes on with fresh connections (a restarted router closed the old)."""

    def __init__(
        self, stats: ClientStats, points: Sequence[int], pause: Callable[[int], None]
    ) -> None:
        self._stats, self._points, self._pause = stats, sorted(points), pause
        self._inner = httpx.AsyncHTTPTransport()
        self._admission = trio.Lock()
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async with self._admission:
            if self._points and self.sent == self._points[0]:
                self._points.pop(0)
                with trio.fail_after(2 * REQUEST_TIMEOUT_S):
                    # `stats` has no event to wait on: a 50 ms poll, three times a run.
                    while self.sent > len(self._stats.ttft_s) + self._stats.errors:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                await trio.to_thread.run_sync(self._pause, self.sent)
                await self._inner.aclose()
                self._inner = httpx.AsyncHTTPTransport()
            self.sent += 1
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

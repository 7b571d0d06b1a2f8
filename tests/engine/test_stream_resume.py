"""A broken stream resumed on another real engine, token for token: two vLLM engines, greedy
64-token answers, the engine serving a stream SIGKILLed after k events (k spread over the
answer), for streamed completions and streamed chat. In every trial the client's text is
byte for byte the undisturbed run's, its usage adds up, it gets one `[DONE]` and one `id`;
a stop string across the seam ends where the undisturbed run ends. Beside it, smg and
vllm-router with the same kill cut the stream.

Each kill costs an engine restart (67-201 s on two shared cores), so the router has
`ROUTER_RESUME_ENGINES` engines (default 3): a killed engine restarts in the background
while the next trials run on the others, and a trial waits only until two engines (one to
serve, one to go on) are healthy. The number of trials per route is `ROUTER_RESUME_TRIALS`
(default 20); -rP prints what was measured, and each trial says whether the kill found the
stream still generating (a resume) or the answer already whole in the router.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from conformance.engines import Engine, EngineEnvironment, EngineSettings
from conformance.processes import free_port, open_process
from tests.engine.conftest import EngineHost, host_engines
from tests.engine.helpers import RouterProcess, metric_sum, open_router, scrape
from tests.support.smg_process import smg_command

MODEL = "tiny"
TOKENS = 64
TRIALS = int(os.environ.get("ROUTER_RESUME_TRIALS") or 20)
ENGINES = int(os.environ.get("ROUTER_RESUME_ENGINES") or 3)
ENGINE_ARGS = ("--max-model-len", "1024")
PROMPTS = (
    "Tell me about the cache and the router, then the line.",
    "Naïve café: the world is a router; part first, part last?",
    "You are a router. Hello world, tell me about it:",
)
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TRIAL_TIMEOUT_S = 600.0
PEER_READY_S = 300.0
# The vllm-router console script of the venv running the tests.
VLLM_ROUTER = str(Path(sys.executable).with_name("vllm-router"))


def body(route: str, prompt: str, **extra: Any) -> dict[str, Any]:
    common = {
        "model": MODEL,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if route == "chat":
        return {"messages": [{"role": "user", "content": prompt}], **common}
    return {"prompt": prompt, **common}


@dataclass
class Seen:
    """What a client made of one streamed answer."""

    text: str = ""
    deltas: list[str] = field(default_factory=list)
    ids: set[Any] = field(default_factory=set)
    usage: list[dict[str, Any]] = field(default_factory=list)
    finish: list[Any] = field(default_factory=list)
    done: int = 0
    errors: list[Any] = field(default_factory=list)
    events_at_kill: int = 0

    def take(self, line: str) -> None:
        if line.startswith("event: error"):
            self.errors.append(line)
            return
        if not line.startswith("data: "):
            return
        data = line[len("data: ") :]
        if data == "[DONE]":
            self.done += 1
            return
        chunk = orjson.loads(data)
        if "error" in chunk:
            self.errors.append(chunk["error"])
            return
        self.ids.add((chunk["id"], chunk["created"], chunk["model"]))
        if chunk.get("usage"):
            self.usage.append(
                {k: chunk["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
            )
        for choice in chunk["choices"]:
            delta = choice.get("delta")
            piece = (delta.get("content") or "") if delta is not None else choice["text"]
            self.deltas.append(piece)
            self.text += piece
            if choice.get("finish_reason") is not None:
                self.finish.append((choice["finish_reason"], choice.get("stop_reason")))


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    settings = [EngineSettings(served_model_name=MODEL, extra_args=ENGINE_ARGS)] * ENGINES
    yield from host_engines(settings, name="resume")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(EngineEnvironment.from_env().model_dir)


@pytest.fixture
async def router(host: EngineHost, model_dir: str) -> AsyncIterator[RouterProcess]:
    for engine in host.engines:
        await host.ensure_running(engine)
    args = [
        *(a for e in host.engines for a in ("--worker", f"{e.url},model={MODEL},engine=vllm")),
        "--kv-tokenizer",
        model_dir,
        "--resume-limit",
        "2",
        "--health-interval-s",
        "1",
        "--health-timeout-s",
        "2",
        "--connect-timeout-s",
        "1",
        "--first-byte-timeout-s",
        "120",
        "--log-level",
        "info",
    ]
    async with open_router(*args) as process:
        yield process


async def stream(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    *,
    kill_after: int | None = None,
    engines: list[Engine] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[Seen, Engine | None]:
    """One streamed answer; with `kill_after`, the engine serving it is SIGKILLed once the
    client has that many data events (it is the one the router names, or the one running
    a request)."""
    seen = Seen()
    victim: Engine | None = None
    events = 0
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        named = response.headers.get("x-router-worker")
        async for line in response.aiter_lines():
            seen.take(line)
            if line.startswith("data: "):
                events += 1
            if kill_after is not None and victim is None and events >= kill_after:
                assert engines is not None
                victim = await serving(client, engines, named)
                victim.kill()
                seen.events_at_kill = events
    return seen, victim


async def serving(client: httpx.AsyncClient, engines: list[Engine], named: str | None) -> Engine:
    if named is not None:
        return next(e for e in engines if e.url == named)
    for engine in engines:
        text = (await client.get(f"{engine.url}/metrics")).text
        running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)", text, re.M)
        if running is not None and float(running.group(1)) >= 1:
            return engine
    raise AssertionError("no engine runs the request")


async def back_to_two(
    host: EngineHost, victim: Engine, client: httpx.AsyncClient, router: RouterProcess | None
) -> float:
    """Restart the killed engine; with a router, until its health checks see it again.
    (The engine's process belongs to the host's trio loop: only the host waits on it.)"""
    restart_s = await host.restart(victim)
    if router is not None:
        while True:
            listed = (await client.get(f"{router.url}/v1/workers")).json()["workers"]
            if all(w.get("healthy") for w in listed):
                break
            await trio.sleep(0.2)
    return restart_s


class Restarts:
    """Killed engines restarting in the background (in `nursery`) while the next trials run
    on the others."""

    def __init__(
        self,
        host: EngineHost,
        nursery: trio.Nursery,
        client: httpx.AsyncClient,
        router: RouterProcess,
    ) -> None:
        self.host = host
        self.nursery = nursery
        self.client = client
        self.router = router
        self.restarting: set[str] = set()
        self.took_s: list[float] = []

    def begin(self, victim: Engine) -> None:
        self.restarting.add(victim.url)
        self.nursery.start_soon(self._restart, victim)

    async def _restart(self, victim: Engine) -> None:
        # The host's restart kills what runs and waits in its own loop, which owns the
        # process: waiting on it from this loop broke trio's parking lot.
        self.took_s.append(await self.host.restart(victim))
        self.restarting.discard(victim.url)

    async def wait_for(self, count: int) -> float:
        """Until the router sees `count` healthy engines that are not restarting; the
        seconds waited."""
        started = trio.current_time()
        while True:
            listed = (await self.client.get(f"{self.router.url}/v1/workers")).json()["workers"]
            ready = [w for w in listed if w.get("healthy") and w["url"] not in self.restarting]
            if len(ready) >= count:
                return trio.current_time() - started
            await trio.sleep(0.2)


async def resumed(client: httpx.AsyncClient, router: RouterProcess) -> float:
    """The router's count of streams that went on after a break."""
    samples = await scrape(client, router.url)
    return metric_sum(samples, "router_resumes_total", outcome="resumed") or 0.0


def kill_points(count: int, events: int) -> list[int]:
    """`count` kill points spread over an answer of `events` data events."""
    first, last = 2, events - 3
    return [first + (last - first) * i // max(1, count - 1) for i in range(count)]


async def references(client: httpx.AsyncClient, router: RouterProcess, route: str) -> list[Seen]:
    out = []
    for prompt in PROMPTS:
        seen, _ = await stream(client, router.url + ROUTES[route], body(route, prompt))
        assert (seen.done, seen.errors, len(seen.ids)) == (1, [], 1)
        assert seen.usage[0]["completion_tokens"] == TOKENS
        out.append(seen)
    return out


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_stream_killed_after_k_events_resumes_byte_identical(
    host: EngineHost, router: RouterProcess, route: str
) -> None:
    results = []
    async with httpx.AsyncClient(timeout=120) as client, trio.open_nursery() as nursery:
        restarts = Restarts(host, nursery, client, router)
        with trio.fail_after(TRIAL_TIMEOUT_S):
            undisturbed = await references(client, router, route)
        events = len(undisturbed[0].deltas)  # data events with a choice (chat: the role's too)
        for trial, k in enumerate(kill_points(TRIALS, events)):
            prompt_index = trial % len(PROMPTS)
            reference = undisturbed[prompt_index]
            with trio.fail_after(TRIAL_TIMEOUT_S):
                waited_s = await restarts.wait_for(2)
                before = await resumed(client, router)
                seen, victim = await stream(
                    client,
                    router.url + ROUTES[route],
                    body(route, PROMPTS[prompt_index]),
                    kill_after=k,
                    engines=host.engines,
                )
                assert victim is not None
                restarts.begin(victim)
                went_on = await resumed(client, router) - before
            same = seen.text == reference.text
            results.append((k, same, went_on))
            print(
                f"{route} trial {trial + 1}/{TRIALS}: killed after {seen.events_at_kill} of "
                f"{events} events; {'resumed' if went_on else 'answer already whole'}; text "
                f"{'identical' if same else 'DIFFERENT'}; usage {seen.usage}; "
                f"[DONE] x{seen.done}; ids {len(seen.ids)}; waited {waited_s:.0f} s for two engines"
            )
            assert seen.errors == []
            assert seen.text.encode() == reference.text.encode()
            assert seen.usage == reference.usage
            assert (seen.done, len(seen.ids)) == (1, 1)
        print(f"{route}: waiting for {len(restarts.restarting)} restarts to end")
    print(
        f"{route}: {sum(r[1] for r in results)} of {len(results)} byte-identical, "
        f"{sum(1 for r in results if r[2])} resumed (kill points {[r[0] for r in results]}); "
        f"restarts took {', '.join(f'{t:.0f}' for t in restarts.took_s)} s"
    )
    # A break resumes once. A kill may find the engine already done: the tiny model
    # outruns the client, so the router can hold the whole answer before the client has
    # read k events (seen at k = 2 as at k = 61); no break reached the stream, nothing
    # resumed, and the text above is whole all the same. Every trial's text is checked
    # above, so a break that did not go on fails there; here, most kills must have found
    # the engine generating (17 and 19 of 20 on two shared cores), or the trials did not
    # test a resume at all.
    assert all(r[2] in (0, 1) for r in results)
    assert sum(r[2] for r in results) >= len(results) // 2


async def test_a_stop_string_across_the_seam_ends_where_the_undisturbed_run_ends(
    host: EngineHost, router: RouterProcess
) -> None:
    url = router.url + ROUTES["completions"]
    async with httpx.AsyncClient(timeout=120) as client:
        with trio.fail_after(TRIAL_TIMEOUT_S):
            plain, _ = await stream(client, url, body("completions", PROMPTS[0]))
        # A stop string of 8 characters across event 33 of the undisturbed run.
        end = len("".join(plain.deltas[:33]))
        start = end - 4
        stop = plain.text[start : start + 8]
        while plain.text.find(stop) != start or len(stop) < 8:
            start += 1
            stop = plain.text[start : start + 8]
        with trio.fail_after(TRIAL_TIMEOUT_S):
            undisturbed, _ = await stream(client, url, body("completions", PROMPTS[0], stop=[stop]))
        assert undisturbed.text == plain.text[:start]
        async with trio.open_nursery() as nursery:
            restarts = Restarts(host, nursery, client, router)
            for k in (29, 31, 32):
                with trio.fail_after(TRIAL_TIMEOUT_S):
                    await restarts.wait_for(2)
                    before = await resumed(client, router)
                    seen, victim = await stream(
                        client,
                        url,
                        body("completions", PROMPTS[0], stop=[stop]),
                        kill_after=k,
                        engines=host.engines,
                    )
                    assert victim is not None
                    restarts.begin(victim)
                    went_on = await resumed(client, router) - before
                print(
                    f"stop {stop!r} (completes at event {len(plain.deltas[:33])}): killed after "
                    f"{seen.events_at_kill} events; {'resumed' if went_on else 'not resumed'}; "
                    f"ends {seen.finish}, text "
                    f"{'identical' if seen.text == undisturbed.text else 'DIFFERENT'}"
                )
                assert seen.text == undisturbed.text
                assert seen.finish == undisturbed.finish == [("stop", stop)]
                assert seen.usage == undisturbed.usage
                assert seen.done == 1


@pytest.mark.parametrize("plane", ["smg", "vllm-router"])
async def test_beside_it_the_peers_cut_the_stream(host: EngineHost, plane: str) -> None:
    for engine in host.engines:
        await host.ensure_running(engine)
    port = free_port()
    urls = [engine.url for engine in host.engines]
    if plane == "smg":
        argv = smg_command("--worker-urls", *urls, port=port, metrics_port=free_port())
    else:
        argv = [
            VLLM_ROUTER,
            "--worker-urls",
            *urls,
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
        ]
    url = f"http://127.0.0.1:{port}"
    async with (
        open_process(argv, plane, stop_grace_s=2.0),
        httpx.AsyncClient(timeout=120) as client,
    ):
        # Ready when a unary chat answers (without stream_options: vLLM refuses them on a
        # unary request); what it last said is kept for the failure.
        unary = {k: v for k, v in body("chat", PROMPTS[0]).items() if k != "stream_options"}
        last: object = None
        with trio.move_on_after(PEER_READY_S):
            while True:
                try:
                    ready = await client.post(url + ROUTES["chat"], json={**unary, "stream": False})
                    last = (ready.status_code, ready.text[:300])
                    if ready.status_code == 200:
                        break
                except httpx.HTTPError as exc:
                    last = repr(exc)
                await trio.sleep(0.5)
        assert isinstance(last, tuple) and last[0] == 200, f"{plane} never answered: {last}"
        with trio.fail_after(TRIAL_TIMEOUT_S):
            reference, _ = await stream(client, url + ROUTES["chat"], body("chat", PROMPTS[0]))
            try:
                seen, victim = await stream(
                    client,
                    url + ROUTES["chat"],
                    body("chat", PROMPTS[0]),
                    kill_after=20,
                    engines=host.engines,
                )
                cut_how = f"errors {seen.errors}"
            except httpx.HTTPError as exc:
                seen, victim = Seen(), None
                cut_how = f"the connection ended: {type(exc).__name__}"
            for engine in host.engines:
                if engine.exited or victim is engine:
                    await back_to_two(host, engine, client, None)
    print(
        f"{plane}: engine killed after 20 events: {len(seen.text)} of {len(reference.text)} "
        f"characters, [DONE] x{seen.done}, {cut_how}"
    )
    assert seen.text != reference.text
    assert seen.done == 0 or len(seen.text) < len(reference.text)

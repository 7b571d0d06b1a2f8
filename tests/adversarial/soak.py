"""The soak: many concurrent streams through a real router process, for a bounded time,
against a fleet with a resetting worker, a 503-wedged one and one that breaks every stream
it serves mid-way, with clients that leave.

What it proves is what is left afterwards: no lease (in-flight 0 on every worker), no
upstream connection beyond the idle pool, the router's task count back to its idle value,
its memory no larger than after warm-up (within 10%), and no request lost. The workers
are vLLM fakes and the router has their vocabulary, so a stream the breaking worker cuts
resumes on another worker: every stream in the resume envelope must end whole, with the
unbroken text; a tenth of the requests ask for two choices (outside the envelope), and
those the breaking worker cuts end with the error event, counted by reason.

`make soak` runs the long version (`python -m tests.adversarial.soak`); the suite runs a
ten-second one (`tests/adversarial/test_soak.py`).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import httpx
import orjson
import trio

from router.fake_worker.formats import expected_text
from router.fake_worker.vocabulary import write_tokenizer
from tests.support.cli_process import REPO, Output
from tests.support.traffic import repeat

URL_LINE = re.compile(r"(?:listening on|router listening on) (http://\S+)")
HEALTHY_WORKERS = 3
TOKENS = 20
TOKEN_LATENCY_MS = 50
POOL_MAX_IDLE = 64
BREAK_AFTER_EVENTS = 8
"""The breaking worker's streams end after this many events (the role and 7 tokens)."""
TWO_CHOICES = 0.1
"""The share of requests with n = 2: outside the resume envelope."""


@dataclass(slots=True)
class SoakReport:
    duration_s: float
    streams: int
    sent: int = 0
    completed: int = 0
    left_by_client: int = 0
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    dispatches_at_reset_worker: int = 0
    dispatches_at_wedged_worker: int = 0
    first_burst_at_reset_worker: int | None = None
    """Its dispatches once its breaker opened and its count settled; None: never opened."""
    first_burst_at_wedged_worker: int | None = None
    dispatches_at_breaking_worker: int = 0
    envelope_sent: int = 0
    """Requests in the resume envelope (n = 1) the clients did not leave."""
    envelope_ended_early: int = 0
    """Of those, streams that did not end whole with the unbroken text."""
    envelope_examples: list[str] = field(default_factory=list)
    outside_sent: int = 0
    outside_ended_with_error: int = 0
    """Requests outside the envelope (n = 2) ended with the error event: a break not resumed."""
    resumes: dict[str, float] = field(default_factory=dict)
    """`router_resumes_total` by outcome."""
    refusals: dict[str, float] = field(default_factory=dict)
    """`router_resume_refusals_total` by reason."""
    inflight_after: dict[str, int] = field(default_factory=dict)
    connections_in_use_after: int | None = None
    connections_idle_after: int | None = None
    idle_pool_bound: int = 0
    tasks_before: int | None = None
    tasks_after: int | None = None
    rss_after_warmup_kib: int | None = None
    rss_after_kib: int | None = None

    def problems(self) -> list[str]:
        """Every invariant the run broke, in words; empty when nothing was lost or kept.

        Unknown is a problem too: a figure the run could not read fails the soak.
        """
        found = []
        if self.lost:
            found.append(f"{self.lost} of {self.sent} requests lost, e.g. {self.lost_examples[:3]}")
        if self.envelope_ended_early:
            found.append(
                f"{self.envelope_ended_early} of {self.envelope_sent} streams in the resume "
                f"envelope ended early, e.g. {self.envelope_examples[:3]}"
            )
        if not self.resumes.get("resumed"):
            found.append(f"no stream resumed: {self.resumes}")
        if self.completed == 0:
            found.append("no request completed")
        if any(self.inflight_after.values()) or not self.inflight_after:
            found.append(f"in-flight left on workers: {self.inflight_after}")
        if self.connections_in_use_after != 0:
            found.append(f"upstream connections still in use: {self.connections_in_use_after}")
        if (
            self.connections_idle_after is None
            or self.connections_idle_after > self.idle_pool_bound
        ):
            found.append(
                f"idle upstream connections {self.connections_idle_after} > bound {self.idle_pool_bound}"
            )
        if self.tasks_before is None or self.tasks_after != self.tasks_before:
            found.append(f"router tasks {self.tasks_after} after, {self.tasks_before} before")
        if self.rss_after_warmup_kib is None or self.rss_after_kib is None:
            found.append("router RSS could not be read")
        elif self.rss_after_kib > self.rss_after_warmup_kib * 1.10:
            found.append(
                f"router RSS {self.rss_after_kib} KiB > 110% of {self.rss_after_warmup_kib} KiB after warm-up"
            )
        return found


@asynccontextmanager
async def _child(
    nursery: trio.Nursery, args: Sequence[str]
) -> AsyncIterator[tuple[trio.Process, str]]:
    """`python -m router.cli ARGS`, its URL read from its output; killed on exit."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "router.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    output = Output()
    assert process.stdout is not None
    nursery.start_soon(output.pump, process.stdout)
    try:
        with trio.fail_after(30):
            url = await output.url(URL_LINE)
        yield process, url
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _by_label(scrape: str, name: str, label: str) -> dict[str, float]:
    """A counter's samples summed by one label (over the others)."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", scrape, re.M):
        found = re.search(rf'{label}="([^"]*)"', labels)
        if found is not None:
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(value)
    return out


def _gauge(scrape: str, name: str, labels: str = "") -> int | None:
    match = re.search(rf"^{re.escape(name + labels)} ([0-9.e+]+)$", scrape, re.M)
    return int(float(match.group(1))) if match else None


async def _one_stream(address: tuple[str, int], rng: random.Random, report: SoakReport) -> None:
    """One streamed chat request on its own connection; a fifth of the clients leave
    after the first bytes of the answer, a tenth of the requests ask for two choices."""
    choices = 2 if rng.random() < TWO_CHOICES else 1
    body = orjson.dumps(
        {
            "model": "fake-model",
            "stream": True,
            "max_tokens": TOKENS,
            "n": choices,
            "messages": [{"role": "user", "content": f"soak {rng.random()}"}],
        }
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    leave = rng.random() < 0.2
    report.sent += 1
    received = bytearray()
    try:
        stream = await trio.open_tcp_stream(*address)
    except OSError as exc:
        _lose(report, f"connect: {exc}")
        return
    async with stream:
        try:
            await stream.send_all(head + body)
            while chunk := await stream.receive_some(65536):
                received += chunk
                if leave and b"data: " in received:
                    report.left_by_client += 1
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            _lose(report, f"transport: {exc!r}")
            return
    whole = b"data: [DONE]" in received and b"event: error" not in received
    if choices == 1:
        report.envelope_sent += 1
        text = _stream_text(bytes(received))
        if not whole or text != expected_text(TOKENS):
            report.envelope_ended_early += 1
            if len(report.envelope_examples) < 10:
                report.envelope_examples.append(f"{text!r} {bytes(received[-160:])!r}")
    else:
        report.outside_sent += 1
        if b"event: error" in received and received.startswith(b"HTTP/1.1 200"):
            report.outside_ended_with_error += 1
            report.completed += 1  # an honest end: the break, said
            return
    if received.startswith(b"HTTP/1.1 200") and whole:
        report.completed += 1
    else:
        _lose(report, bytes(received[:200]).decode(errors="replace"))


def _stream_text(response: bytes) -> str:
    """The text of a chunked SSE chat answer (one choice)."""
    _, _, body = response.partition(b"\r\n\r\n")
    data = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        data += rest[:size]
        body = rest[size + 2 :]
    text = []
    for event in bytes(data).split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in orjson.loads(event[6:]).get("choices") or ():
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def _lose(report: SoakReport, what: str) -> None:
    report.lost += 1
    if len(report.lost_examples) < 10:
        report.lost_examples.append(what)


async def _client_loop(
    address: tuple[str, int], seed: int, until: float, report: SoakReport
) -> None:
    # Bounded by count as well as by time: one stream per token interval is far more than
    # a client gets through (a whole stream takes TOKENS of them).
    most = math.ceil((until - trio.current_time()) * 1000 / TOKEN_LATENCY_MS)
    await repeat(partial(_one_stream, address, random.Random(seed), report), until=until, most=most)


async def run_soak(duration_s: float, streams: int) -> SoakReport:
    """Run the soak and read what the router holds afterwards."""
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        return await _soak(duration_s, streams, Path(scratch))


async def _soak(duration_s: float, streams: int, scratch: Path) -> SoakReport:
    report = SoakReport(duration_s=duration_s, streams=streams)
    fake = [
        "fake-worker",
        "--port",
        "0",
        "--engine",
        "vllm",
        "--tokens",
        str(TOKENS),
        "--token-latency-ms",
        str(TOKEN_LATENCY_MS),
    ]
    breaks = ["--fail-first", "-1", "--fail-mode", "midstream"]
    async with trio.open_nursery() as nursery:
        workers = []
        async with (
            _child(nursery, fake) as (_, healthy_a),
            _child(nursery, fake) as (_, healthy_b),
            _child(nursery, fake) as (_, healthy_c),
            _child(nursery, [*fake, "--fail-first", "-1", "--fail-mode", "reset"]) as (
                _,
                resetting,
            ),
            _child(nursery, [*fake, "--fail-first", "-1", "--fail-status", "503"]) as (_, wedged),
            _child(nursery, [*fake, *breaks, "--fail-after-chunks", str(BREAK_AFTER_EVENTS)]) as (
                _,
                breaking,
            ),
        ):
            workers = [healthy_a, healthy_b, healthy_c, resetting, wedged, breaking]
            report.idle_pool_bound = POOL_MAX_IDLE * len(workers)
            args = [
                "serve",
                "--port",
                "0",
                "--log-level",
                "info",
                "--health-interval-s",
                "3600",
                "--pool-max-idle-per-worker",
                str(POOL_MAX_IDLE),
                "--kv-tokenizer",
                str(await trio.to_thread.run_sync(write_tokenizer, scratch / "tokenizer.json")),
            ]
            for url in workers:
                args += ["--worker", f"{url},engine=vllm"]
            async with (
                _child(nursery, args) as (router, router_url),
                httpx.AsyncClient(base_url=router_url, timeout=10) as http,
            ):
                host, _, port = router_url.removeprefix("http://").rpartition(":")
                address = (host, int(port))
                # One request each way before the baseline: lazy state (pool endpoints,
                # metric children) exists from here on.
                warm = SoakReport(duration_s=0, streams=1)
                await _one_stream(address, random.Random(0), warm)
                await _wait_idle(http, workers)
                report.tasks_before = _gauge((await http.get("/metrics")).text, "router_tasks")
                start = trio.current_time()
                until = start + duration_s
                async with trio.open_nursery() as clients:
                    for index in range(streams):
                        clients.start_soon(_client_loop, address, index, until, report)
                    clients.start_soon(_first_bursts, http, resetting, wedged, until, report)
                    await trio.sleep(duration_s * 0.2)
                    report.rss_after_warmup_kib = _rss_kib(router.pid)
                await _wait_idle(http, workers)
                scrape = (await http.get("/metrics")).text
                report.tasks_after = _gauge(scrape, "router_tasks")
                report.connections_in_use_after = _gauge(
                    scrape, "router_upstream_connections", '{state="in_use"}'
                )
                report.connections_idle_after = _gauge(
                    scrape, "router_upstream_connections", '{state="idle"}'
                )
                report.inflight_after = {
                    w["id"]: w["inflight"]
                    for w in (await http.get("/v1/workers")).json()["workers"]
                }
                report.rss_after_kib = _rss_kib(router.pid)
                async with httpx.AsyncClient(timeout=5) as direct:
                    report.dispatches_at_reset_worker = (
                        await direct.get(resetting + "/debug/routing")
                    ).json()["dispatches"]
                    report.dispatches_at_wedged_worker = (
                        await direct.get(wedged + "/debug/routing")
                    ).json()["dispatches"]
                    report.dispatches_at_breaking_worker = (
                        await direct.get(breaking + "/debug/routing")
                    ).json()["dispatches"]
                report.resumes = _by_label(scrape, "router_resumes_total", "outcome")
                report.refusals = _by_label(scrape, "router_resume_refusals_total", "reason")
        nursery.cancel_scope.cancel()
    return report


async def _first_bursts(
    http: httpx.AsyncClient, resetting: str, wedged: str, until: float, report: SoakReport
) -> None:
    """Each bad worker's dispatches at the end of the first burst: once the router shows
    its breaker open and the worker's own count stopped moving (requests sent before
    the breaker opened have arrived). From then on only the breaker's probes reach it."""
    bad = {resetting: "first_burst_at_reset_worker", wedged: "first_burst_at_wedged_worker"}
    async with httpx.AsyncClient(timeout=5) as direct:
        with trio.move_on_at(until):
            while bad:
                scrape = (await http.get("/metrics")).text
                for url in list(bad):
                    state = _gauge(scrape, "router_worker_breaker_state", f'{{worker="{url}"}}')
                    if state == 1:
                        count = await _settled_dispatches(direct, url)
                        setattr(report, bad.pop(url), count)
                await trio.sleep(0.05)


async def _settled_dispatches(direct: httpx.AsyncClient, url: str) -> int:
    previous = -1
    while True:
        count = int((await direct.get(url + "/debug/routing")).json()["dispatches"])
        if count == previous:
            return count
        previous = count
        await trio.sleep(0.5)


async def _wait_idle(http: httpx.AsyncClient, workers: list[str], timeout_s: float = 15) -> None:
    """Until the router shows no request in flight and no connection checked out (or the
    timeout: the report then shows what was left)."""
    with trio.move_on_after(timeout_s):
        while True:
            scrape = (await http.get("/metrics")).text
            listing = (await http.get("/v1/workers")).json()["workers"]
            if _gauge(scrape, "router_upstream_connections", '{state="in_use"}') == 0 and not any(
                w["inflight"] for w in listing
            ):
                # The scrape's own request is in flight on the router: one more pass lets
                # the connections the load left behind finish closing.
                await trio.sleep(0.2)
                return
            await trio.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.adversarial.soak", description=__doc__)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=1000)
    args = parser.parse_args(argv)
    report = trio.run(run_soak, args.duration_s, args.streams)
    print(orjson.dumps(asdict(report), option=orjson.OPT_INDENT_2).decode())
    problems = report.problems()
    for problem in problems:
        print("PROBLEM:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

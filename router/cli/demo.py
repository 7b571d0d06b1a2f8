"""`router demo`: the router in front of three embedded fake workers, in one process.

What `make demo` runs: nothing to install beyond the package, no GPU, no etcd. It prints
a curl command and an `openai` client snippet to try, and stops on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from functools import partial

import trio

from router.cli.config import Settings
from router.cli.serve import RunningRouter, run_router
from router.discovery.static import parse_worker_spec
from router.fake_worker.engine import serve_fake_worker
from router.fake_worker.settings import FakeWorkerSettings
from router.observability.logs import configure_logging

MODEL = "fake-model"


def _instructions(router: RunningRouter, worker_urls: list[str]) -> str:
    url = router.url
    return f"""
router demo: the router is listening on {url}, in front of {len(worker_urls)} fake workers:
  {chr(10).join("  " + w for w in worker_urls).strip()}

Try it:
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hello"}}], "max_tokens": 8}}'
  curl -sN {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hello"}}], "stream": true}}'
  curl -s {url}/v1/workers      # the fleet, with health, breaker state and load
  curl -s {url}/metrics         # Prometheus metrics

With the openai client (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  reply = client.chat.completions.create(model="{MODEL}", messages=[{{"role": "user", "content": "hi"}}])
  print(reply.choices[0].message.content)

Each answer carries `x-router-worker`: the worker that served it. Ctrl-C stops the demo.
""".rstrip()


async def run_demo(port: int, workers: int, token_latency_ms: float) -> None:
    async with trio.open_nursery() as nursery:
        urls = []
        for _ in range(workers):
            fake = FakeWorkerSettings(model=MODEL, tokens=16, token_latency_ms=token_latency_ms)
            urls.append(await nursery.start(partial(serve_fake_worker, fake)))
        settings = Settings.defaults(
            port=port, workers=tuple(parse_worker_spec(url) for url in urls)
        )
        shutdown = trio.Event()
        router: RunningRouter = await nursery.start(
            partial(run_router, settings, shutdown=shutdown)
        )
        print(_instructions(router, urls), flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        print("\nrouter demo: stopping", flush=True)
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="router demo", description=__doc__)
    parser.add_argument(
        "--port", type=int, default=8080, help="router port (default 8080; 0 picks one)"
    )
    parser.add_argument("--workers", type=int, default=3, help="fake workers (default 3)")
    parser.add_argument(
        "--token-latency-ms", type=float, default=20.0, help="fake time between tokens"
    )
    args = parser.parse_args(list(argv))
    configure_logging(logging.WARNING)
    exit_code = 0
    try:
        trio.run(run_demo, args.port, args.workers, args.token_latency_ms)
    except* OSError as group:
        print(
            f"router demo: cannot listen on port {args.port}: {group.exceptions[0]} (try --port 0)",
            file=sys.stderr,
        )
        exit_code = 3
    return exit_code

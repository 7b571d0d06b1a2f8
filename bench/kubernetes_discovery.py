"""How fast Kubernetes discovery acts on Pod events: `python -m bench.kubernetes_discovery`.

Against the fake API server of the tests (tests/support/fake_kube_api.py) and two fake
workers on loopback, with a router discovering through a kubeconfig, `--runs` times each:
- deletionTimestamp -> out of routing: from the API server recording the MODIFIED event
  that sets `deletionTimestamp` to the router's fleet showing the worker DRAINING;
- Ready -> first request routed: from the MODIFIED event that makes a Pod Ready to the
  answer of the first request the router sent to it (requests are sent back to back).
Prints the median, min and max of each. Figures from a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path

import httpx
import trio

from router.cli.config import Settings
from router.cli.serve import RunningRouter, run_router
from tests.support.fake_fleet import open_fake_fleet
from tests.support.fake_kube_api import FakeKubeApi
from tests.support.kube_fleet import worker_pod, write_kubeconfig

APP = {"app": "engine"}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
POLL_S = 0.0002


async def _until(condition: object) -> None:
    while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - the fleet offers no event
        await trio.sleep(POLL_S)


async def measure(runs: int) -> dict[str, list[float]]:
    api = FakeKubeApi()
    results: dict[str, list[float]] = {
        "deletionTimestamp -> out of routing": [],
        "Ready -> first request routed": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        async with open_fake_fleet(2) as (base, new), trio.open_nursery() as nursery:
            api.add_pod(worker_pod(base, "base", APP))
            await nursery.start(api.serve)
            settings = Settings.defaults(
                port=0,
                health_interval_s=3600.0,
                discovery="kubernetes",
                k8s_selector="app=engine",
                k8s_kubeconfig=str(write_kubeconfig(Path(scratch), api)),
                log_level="warning",
            )
            router: RunningRouter = await nursery.start(partial(run_router, settings))
            fleet = router.fleet
            async with httpx.AsyncClient(base_url=router.url) as client:
                for run in range(runs):
                    name = f"new-{run}"
                    worker_id = f"default/{name}"
                    api.add_pod(worker_pod(new, name, APP, ready=False))
                    await trio.sleep(0.05)
                    api.set_ready(name, True)
                    ready_at = trio.current_time()
                    while True:
                        response = await client.post("/v1/chat/completions", json=CHAT)
                        if response.headers.get("x-router-worker") == worker_id:
                            break
                    results["Ready -> first request routed"].append(trio.current_time() - ready_at)

                    api.begin_deletion(name, grace_s=15)
                    deleted_at = trio.current_time()
                    await _until(lambda wid=worker_id: (w := fleet.get(wid)) is None or w.draining)
                    results["deletionTimestamp -> out of routing"].append(
                        trio.current_time() - deleted_at
                    )
                    api.finish_deletion(name)
                    await _until(lambda wid=worker_id: fleet.get(wid) is None)
            nursery.cancel_scope.cancel()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kubernetes_discovery", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    results = trio.run(measure, args.runs)
    print("| what | median | min | max | runs |\n|---|---|---|---|---|")
    for what, values in results.items():
        ms = [v * 1000 for v in values]
        print(
            f"| {what} | {statistics.median(ms):.1f} ms | {min(ms):.1f} ms | {max(ms):.1f} ms | {len(ms)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fake Kubernetes API server as a process of its own, for a driver that may not import
it (the conformance runner starts it from the repository root):

    python -m tests.support.fake_kube_api_process [--token T]

serves on 127.0.0.1, port 0, prints `fake kube api listening on URL` and serves until
killed. Pods are created, patched and deleted over its HTTP API (see fake_kube_api).
"""

from __future__ import annotations

import argparse

import trio

from tests.support.fake_kube_api import FakeKubeApi


async def serve_until_killed(token: str) -> None:
    api = FakeKubeApi(token=token)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(api.serve)
        print(f"fake kube api listening on {url}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="A fake Kubernetes API server for Pods, on 127.0.0.1"
    )
    parser.add_argument("--token", default="test-token", help="the bearer token it requires")
    trio.run(serve_until_killed, parser.parse_args().token)


if __name__ == "__main__":
    main()

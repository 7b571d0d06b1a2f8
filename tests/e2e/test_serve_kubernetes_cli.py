"""`router serve --discovery kubernetes` as an operator runs it: a subprocess following a
fake API server through a kubeconfig, and the exit status of a configuration it cannot use."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.support.cli_process import open_cli_piped, run_cli
from tests.support.fake_fleet import open_fake_fleet
from tests.support.fake_kube_api import FakeKubeApi
from tests.support.kube_fleet import worker_pod, write_kubeconfig


async def test_serve_follows_pods_and_drains_a_terminating_one(tmp_path: Path) -> None:
    api = FakeKubeApi()
    with trio.fail_after(60):
        async with open_fake_fleet(2) as (w0, w1), trio.open_nursery() as nursery:
            api.add_pod(worker_pod(w0, "w-0", {"app": "engine"}))
            api.add_pod(worker_pod(w1, "w-1", {"app": "engine"}))
            await nursery.start(api.serve)
            kubeconfig = write_kubeconfig(tmp_path, api)
            async with open_cli_piped(
                "serve",
                "--port",
                "0",
                "--discovery",
                "kubernetes",
                "--k8s-selector",
                "app=engine",
                "--k8s-kubeconfig",
                str(kubeconfig),
            ) as (router, _, err):
                url = await err.url(r"router listening on (http://\S+) with 2 workers")
                body = {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                }
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    served = {
                        (await client.post("/v1/chat/completions", json=body)).headers[
                            "x-router-worker"
                        ]
                        for _ in range(4)
                    }
                    assert served == {"default/w-0", "default/w-1"}
                    api.begin_deletion("w-1", grace_s=15)
                    await err.wait_for(r"Pod default/w-1 is terminating: DRAINING")
                    after = [
                        (await client.post("/v1/chat/completions", json=body)) for _ in range(4)
                    ]
                    health = (await client.get("/health")).json()
                assert [(r.status_code, r.headers["x-router-worker"]) for r in after] == [
                    (200, "default/w-0")
                ] * 4
                assert health["discovery"] == {
                    "source": "kubernetes",
                    "up": True,
                    "detail": health["discovery"]["detail"],
                }
                assert router.returncode is None
            nursery.cancel_scope.cancel()
    assert "Traceback" not in err.text


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--discovery", "kubernetes"], "Kubernetes discovery needs --k8s-selector"),
        (
            ["--discovery", "kubernetes", "--k8s-selector", "app"],
            "label selector term 'app' is not key=value",
        ),
        (
            [
                "--discovery",
                "kubernetes",
                "--k8s-selector",
                "app=x",
                "--k8s-kubeconfig",
                "/nonexistent/kubeconfig",
            ],
            "kubeconfig /nonexistent/kubeconfig: [Errno 2]",
        ),
    ],
)
async def test_a_kubernetes_setting_it_cannot_use_exits_2_with_the_reason(
    args: list[str], complaint: str
) -> None:
    with trio.fail_after(30):
        result = await run_cli("serve", "--port", "0", *args)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert complaint in stderr
    assert "Traceback" not in stderr

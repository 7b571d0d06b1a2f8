"""The deployment files hold together: every manifest parses, the router's Role grants
exactly what discovery calls, the router's flags are ones it accepts, the example workers
match its selector, and the wheel the Dockerfile installs has the entrypoint it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trio
import yaml

from router.cli.config import load_settings
from router.cli.serve import build_parser
from router.discovery.kube_pods import Selector, pod_sources
from tests.support.fake_fleet import open_fake_fleet
from tests.support.fake_kube_api import FakeKubeApi
from tests.support.kube_fleet import worker_pod, write_kubeconfig
from tests.support.router_instance import open_router
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "deploy" / "kubernetes"


def documents() -> dict[str, list[dict[str, Any]]]:
    by_file = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        by_file[path.name] = docs
    return by_file


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for docs in documents().values()
        for doc in docs
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def test_every_manifest_parses_and_names_its_kind() -> None:
    files = documents()
    assert set(files) == {
        "router.yaml",
        "worker-example.yaml",
        "worker-pd-example.yaml",
        "worker-agent-example.yaml",
    }
    for name, docs in files.items():
        assert docs, name
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], name
    kinds = sorted(doc["kind"] for doc in files["router.yaml"])
    assert kinds == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]


def test_the_role_grants_get_list_watch_on_pods_and_nothing_more() -> None:
    role = find("Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = find("RoleBinding")
    account = find("ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    router = find("Deployment", "trio-router")
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def _verb(method: str, target: str) -> str:
    split = urlsplit(target)
    parts = split.path.strip("/").split("/")
    query = parse_qs(split.query)
    assert method == "GET", f"discovery wrote to the API server: {method} {target}"
    if len(parts) > 5:
        return "get"
    return "watch" if query.get("watch") else "list"


async def test_discovery_calls_only_verbs_the_role_grants(tmp_path: Path) -> None:
    api = FakeKubeApi()
    with trio.fail_after(30):
        async with open_fake_fleet(1) as (w0,), trio.open_nursery() as nursery:
            api.add_pod(worker_pod(w0, "w-0", {"app": "sglang-worker"}))
            await nursery.start(api.serve)
            kubeconfig = write_kubeconfig(tmp_path, api)
            async with open_router(
                discovery="kubernetes",
                k8s_kubeconfig=str(kubeconfig),
                k8s_selector="app=sglang-worker",
            ) as router:
                await wait_until(lambda: api.watches_open == 1)
                api.add_pod(
                    worker_pod(w0, "other", {"app": "db"})
                )  # a change this watch never sees
                api.compact()
                api.end_watches()  # resume, 410, relist, watch again
                await wait_until(lambda: sum(1 for m, t in api.requests if "watch=1" in t) >= 3)
                assert len(router.fleet) == 1
            nursery.cancel_scope.cancel()
    used = {_verb(method, target) for method, target in api.requests}
    assert used == {"list", "watch"}
    assert used <= set(find("Role")["rules"][0]["verbs"])


def _router_args() -> list[str]:
    container = find("Deployment", "trio-router")["spec"]["template"]["spec"]["containers"][0]
    return list(container["args"])


def test_the_router_deployment_passes_flags_router_serve_accepts() -> None:
    args = build_parser().parse_args(_router_args())
    settings = load_settings(args, environ={})
    assert settings.discovery == "kubernetes" and settings.host == "0.0.0.0"
    container = find("Deployment", "trio-router")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "trio-router:0.1.0"
    assert container["ports"][0]["containerPort"] == settings.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    grace = find("Deployment", "trio-router")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert grace > settings.shutdown_grace_s


def test_the_example_workers_match_the_selectors_and_drain_gracefully() -> None:
    settings = load_settings(build_parser().parse_args(_router_args()), environ={})
    (mixed,) = pod_sources(settings.k8s_selector, "", "")
    examples = [
        find("Deployment", "sglang-worker"),
        find("Deployment", "sglang-prefill"),
        find("Deployment", "sglang-decode"),
    ]
    assert mixed.selector.matches(examples[0]["spec"]["template"]["metadata"]["labels"])
    pd_header = (MANIFESTS / "worker-pd-example.yaml").read_text().splitlines()
    prefill_flag = next(line for line in pd_header if "--k8s-prefill-selector=" in line)
    prefill = Selector.parse(prefill_flag.split("--k8s-prefill-selector=")[1].split()[0])
    assert prefill.matches(examples[1]["spec"]["template"]["metadata"]["labels"])
    assert not prefill.matches(examples[2]["spec"]["template"]["metadata"]["labels"])
    assert (
        examples[1]["spec"]["template"]["metadata"]["annotations"]["sglang.ai/bootstrap-port"]
        == "8998"
    )
    for deployment in examples:
        spec = deployment["spec"]["template"]["spec"]
        engine = spec["containers"][0]
        sleep = int(engine["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
        assert spec["terminationGracePeriodSeconds"] > sleep
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": 1,
            "maxUnavailable": 0,
        }


def test_the_agent_example_runs_router_agent_with_flags_it_accepts() -> None:
    from router.agent.cli import build_parser as agent_parser

    spec = find("Deployment", "sglang-worker-etcd")["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    assert agent["command"] == ["router", "agent"]
    args = agent_parser().parse_args(agent["args"])
    assert spec["terminationGracePeriodSeconds"] > args.drain_timeout_s


def test_the_wheel_the_dockerfile_installs_has_the_router_entrypoint(tmp_path: Path) -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in dockerfile
    assert 'ENTRYPOINT ["router", "serve"]' in dockerfile
    assert "USER 10001" in dockerfile and "useradd" in dockerfile
    assert "pip wheel --no-cache-dir --no-deps" in dockerfile
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
        # The packaging, not the compile: `make test-compiled` holds the compiled build.
        env={**os.environ, "ROUTER_PURE_PYTHON": "1"},
    )
    (wheel,) = tmp_path.glob("trio_router-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(
            archive.read(n).decode() for n in names if n.endswith("entry_points.txt")
        )
    assert "router = router.cli:main" in entry_points
    for module in (
        "router/cli/main.py",
        "router/cli/serve.py",
        "router/discovery/kubernetes.py",
        "router/engines/facts.py",
    ):
        assert module in names

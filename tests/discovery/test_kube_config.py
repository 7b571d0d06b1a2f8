"""Where the API server is and how to authenticate: kubeconfig, in-cluster, the order
between them, and a token file read again when it rotates."""

from __future__ import annotations

import base64
import os
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.discovery.kube_config import (
    BearerToken,
    BearerTokenFile,
    KubeConfigError,
    load_kube_connection,
)


def kubeconfig(
    path: Path, *, cluster: dict[str, Any], user: dict[str, Any], namespace: str | None = "workers"
) -> Path:
    context: dict[str, Any] = {"cluster": "c", "user": "u"}
    if namespace:
        context["namespace"] = namespace
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "ctx", "context": context}],
                "current-context": "ctx",
            }
        )
    )
    return path


def header(auth: httpx.Auth | None) -> str:
    assert auth is not None
    request = httpx.Request("GET", "http://api/")
    flow = auth.sync_auth_flow(request)
    return next(flow).headers["authorization"]


def test_a_kubeconfig_with_a_token_and_its_context_namespace(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path / "config", cluster={"server": "http://127.0.0.1:6443/"}, user={"token": "abc"}
    )
    connection = load_kube_connection(str(path), environ={})
    assert (connection.server, connection.namespace) == ("http://127.0.0.1:6443", "workers")
    assert isinstance(connection.auth, BearerToken) and header(connection.auth) == "Bearer abc"
    assert "context ctx" in connection.source


def test_a_kubeconfig_with_inline_ca_data_and_a_relative_token_file(tmp_path: Path) -> None:
    ca = ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"
    pem = Path(ca).read_text()
    start = pem.index("-----BEGIN CERTIFICATE-----")
    first = (
        pem[
            start : pem.index("-----END CERTIFICATE-----", start) + len("-----END CERTIFICATE-----")
        ]
        + "\n"
    )
    (tmp_path / "token").write_text("from-file\n")
    path = kubeconfig(
        tmp_path / "config",
        cluster={
            "server": "https://k8s:6443",
            "certificate-authority-data": base64.b64encode(first.encode()).decode(),
        },
        user={"tokenFile": "token"},
        namespace=None,
    )
    connection = load_kube_connection(str(path), environ={})
    assert isinstance(connection.verify, ssl.SSLContext) and connection.namespace is None
    assert header(connection.auth) == "Bearer from-file"


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"exec": {"command": "aws"}}, "uses exec"),
        ({"auth-provider": {"name": "gcp"}}, "uses auth-provider"),
    ],
)
def test_auth_the_router_does_not_run_is_refused_clearly(
    tmp_path: Path, user: dict[str, Any], message: str
) -> None:
    path = kubeconfig(
        tmp_path / "config",
        cluster={"server": "https://k8s:6443", "insecure-skip-tls-verify": True},
        user=user,
    )
    with pytest.raises(KubeConfigError, match=message):
        load_kube_connection(str(path), environ={})


def test_a_broken_kubeconfig_says_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "b").write_text("clusters: []\n")
    with pytest.raises(KubeConfigError, match="no current-context"):
        load_kube_connection(str(tmp_path / "b"), environ={})
    with pytest.raises(KubeConfigError, match="server must be an http"):
        load_kube_connection(
            str(kubeconfig(tmp_path / "c", cluster={"server": "k8s:6443"}, user={})), environ={}
        )
    with pytest.raises(KubeConfigError, match="No such file"):
        load_kube_connection(str(tmp_path / "missing"), environ={})


def test_in_cluster_comes_before_kubeconfig_and_names_the_pods_namespace(tmp_path: Path) -> None:
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("sa-token")
    (account / "namespace").write_text("inference\n")
    other = kubeconfig(
        tmp_path / "config", cluster={"server": "http://elsewhere:1"}, user={"token": "x"}
    )
    environ = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBECONFIG": str(other),
    }
    connection = load_kube_connection(None, environ=environ, service_account_dir=account)
    assert (connection.server, connection.namespace) == ("https://10.96.0.1:443", "inference")
    assert header(connection.auth) == "Bearer sa-token"
    # outside a cluster: KUBECONFIG, then ~/.kube/config
    outside = load_kube_connection(
        None, environ={"KUBECONFIG": str(other)}, service_account_dir=tmp_path / "none"
    )
    assert outside.server == "http://elsewhere:1"
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    kubeconfig(home / ".kube" / "config", cluster={"server": "http://home:1"}, user={})
    assert (
        load_kube_connection(
            None, environ={"HOME": str(home)}, service_account_dir=tmp_path / "none"
        ).server
        == "http://home:1"
    )
    with pytest.raises(KubeConfigError, match="no Kubernetes configuration"):
        load_kube_connection(
            None, environ={"HOME": str(tmp_path / "nobody")}, service_account_dir=tmp_path / "none"
        )


def test_a_rotated_token_file_is_read_again_and_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("one")
    auth = BearerTokenFile(token)
    assert header(auth) == "Bearer one"
    reads = []
    original = Path.read_text

    def counting(self: Path, *args: Any, **kwargs: Any) -> str:
        reads.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    assert header(auth) == "Bearer one"
    assert reads == []  # unchanged: not read again
    # the kubelet swaps the file (a new inode), as on a projected volume
    (tmp_path / "token.new").write_bytes(b"two")
    os.replace(tmp_path / "token.new", token)
    assert header(auth) == "Bearer two" and reads == [token]
    monkeypatch.undo()
    token.unlink()
    with pytest.raises(KubeConfigError, match="bearer token file"):
        header(auth)

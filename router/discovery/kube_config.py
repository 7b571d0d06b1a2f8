"""Where the Kubernetes API server is and how to authenticate to it.

In order: an explicit kubeconfig file (`--k8s-kubeconfig`); the in-cluster service
account (`KUBERNETES_SERVICE_HOST`/`_PORT` and the mounted token, CA and namespace); the
kubeconfig named by `KUBECONFIG` (its first path); `~/.kube/config`. Of a kubeconfig the
current context is used: its cluster's `server`, `certificate-authority(-data)` or
`insecure-skip-tls-verify`, its user's `token`, `tokenFile` or
`client-certificate(-data)`/`client-key(-data)`. Exec plugins and auth providers are
refused with a clear message rather than half supported.

Why not a client library: `lightkube` runs under trio (its AsyncClient listed and
watched our fake API server under `trio.run`, a 410 surfaced as `ApiError`), but its
`watch()` cannot ask for `allowWatchBookmarks` and sets no read bound on the stream, and
it would bring a second HTTP stack (httpx2, msgspec, its models) into the router for what
is two GET requests. The router already speaks httpx; this module is the part of a
client it needs: the connection facts above, and a bearer token file re-read whenever
it changes (bound service-account tokens rotate about hourly).
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """No usable connection to the API server could be configured; the message says why."""


@dataclass(frozen=True, slots=True)
class KubeConnection:
    server: str
    verify: ssl.SSLContext | bool
    auth: httpx.Auth | None
    namespace: str | None
    """The namespace the configuration names (the router's own Pod's, in a cluster)."""
    source: str


class BearerTokenFile(httpx.Auth):
    """`Authorization: Bearer <token>` read from a file, read again whenever the file
    changes (its inode, size or mtime), so a rotated token is used from the next request."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int, int] | None = None
        self._header = ""

    def header(self) -> str:
        try:
            info = self._path.stat()
        except OSError as exc:
            raise KubeConfigError(f"bearer token file {self._path}: {exc}") from None
        stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
        if stamp != self._stamp:
            try:
                token = self._path.read_text().strip()
            except OSError as exc:
                raise KubeConfigError(f"bearer token file {self._path}: {exc}") from None
            self._header, self._stamp = f"Bearer {token}", stamp
        return self._header

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = self.header()
        yield request


class BearerToken(httpx.Auth):
    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token.strip()}"

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = self._header
        yield request


def load_kube_connection(
    kubeconfig: str | None = None,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConnection:
    """The connection by the order in the module docstring; KubeConfigError says why none."""
    environ = os.environ if environ is None else environ
    if kubeconfig:
        return from_kubeconfig(Path(kubeconfig).expanduser())
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if host and port and (service_account_dir / "token").exists():
        return in_cluster(host, port, service_account_dir)
    if environ.get("KUBECONFIG"):
        return from_kubeconfig(Path(environ["KUBECONFIG"].split(os.pathsep)[0]).expanduser())
    default = Path(environ.get("HOME", "~")).expanduser() / ".kube" / "config"
    if default.exists():
        return from_kubeconfig(default)
    raise KubeConfigError(
        "no Kubernetes configuration: not in a cluster (no KUBERNETES_SERVICE_HOST and "
        f"service account token), no KUBECONFIG, no {default}; pass --k8s-kubeconfig"
    )


def in_cluster(host: str, port: str, account: Path) -> KubeConnection:
    server_host = f"[{host}]" if ":" in host else host
    ca = account / "ca.crt"
    verify: ssl.SSLContext | bool = (
        ssl.create_default_context(cafile=str(ca)) if ca.exists() else True
    )
    namespace_file = account / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.exists() else None
    return KubeConnection(
        server=f"https://{server_host}:{port}",
        verify=verify,
        auth=BearerTokenFile(account / "token"),
        namespace=namespace or None,
        source=f"in-cluster service account ({account})",
    )


def _named(entries: Any, name: str, kind: str, path: Path) -> dict[str, Any]:
    for entry in entries or []:
        if (
            isinstance(entry, dict)
            and entry.get("name") == name
            and isinstance(entry.get(kind), dict)
        ):
            return entry[kind]
    raise KubeConfigError(f"kubeconfig {path}: no {kind} named {name!r}")


def from_kubeconfig(path: Path) -> KubeConnection:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KubeConfigError(f"kubeconfig {path}: {exc}") from None
    if not isinstance(data, dict):
        raise KubeConfigError(f"kubeconfig {path}: not a mapping")
    context_name = data.get("current-context")
    if not isinstance(context_name, str) or not context_name:
        raise KubeConfigError(f"kubeconfig {path}: no current-context")
    context = _named(data.get("contexts"), context_name, "context", path)
    cluster = _named(data.get("clusters"), str(context.get("cluster")), "cluster", path)
    user = (
        _named(data.get("users"), str(context.get("user")), "user", path)
        if context.get("user")
        else {}
    )
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise KubeConfigError(
            f"kubeconfig {path}: cluster server must be an http(s) URL, got {server!r}"
        )

    def local(name: str) -> str:
        return str((path.parent / name).expanduser())

    verify: ssl.SSLContext | bool = True
    if server.startswith("https://"):
        if cluster.get("insecure-skip-tls-verify"):
            verify = False
        elif cluster.get("certificate-authority-data"):
            verify = ssl.create_default_context(
                cadata=_b64_text(cluster["certificate-authority-data"], path)
            )
        elif cluster.get("certificate-authority"):
            verify = ssl.create_default_context(cafile=local(cluster["certificate-authority"]))
        else:
            verify = ssl.create_default_context()
        if isinstance(verify, ssl.SSLContext):
            _load_client_cert(verify, user, local, path)
    for unsupported in ("exec", "auth-provider"):
        if user.get(unsupported):
            raise KubeConfigError(
                f"kubeconfig {path}: user {context.get('user')!r} uses {unsupported}, which the "
                "router does not run; give it a token, a tokenFile or a client certificate"
            )
    auth: httpx.Auth | None = None
    if user.get("tokenFile"):
        auth = BearerTokenFile(Path(local(str(user["tokenFile"]))))
    elif user.get("token"):
        auth = BearerToken(str(user["token"]))
    namespace = context.get("namespace")
    return KubeConnection(
        server=server.rstrip("/"),
        verify=verify,
        auth=auth,
        namespace=namespace if isinstance(namespace, str) and namespace else None,
        source=f"kubeconfig {path} (context {context_name})",
    )


def _b64_text(value: Any, path: Path) -> str:
    try:
        return base64.b64decode(str(value)).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise KubeConfigError(f"kubeconfig {path}: bad base64 data ({exc})") from None


def _load_client_cert(
    context: ssl.SSLContext, user: dict[str, Any], local: Any, path: Path
) -> None:
    cert, key = user.get("client-certificate"), user.get("client-key")
    cert_data, key_data = user.get("client-certificate-data"), user.get("client-key-data")
    if not (cert or cert_data):
        return
    # The ssl module loads a certificate chain from files only: data goes through a
    # private temporary directory that is gone when this returns.
    with tempfile.TemporaryDirectory() as scratch:
        if cert_data:
            cert = Path(scratch, "client.crt")
            cert.write_text(_b64_text(cert_data, path))
        else:
            cert = local(cert)
        if key_data:
            key = Path(scratch, "client.key")
            key.write_text(_b64_text(key_data, path))
        elif key:
            key = local(key)
        try:
            context.load_cert_chain(str(cert), str(key) if key else None)
        except (OSError, ssl.SSLError) as exc:
            raise KubeConfigError(f"kubeconfig {path}: client certificate: {exc}") from None

"""An etcd a plane owns for one case, and worker records written into it.

`start_etcd` runs a single-member etcd (`etcd` on PATH, 3.4+) as a sidecar on loopback
ports with a data dir in the case's scratch folder; the runner stops it with the case.
Records are written and deleted over etcd's v3 JSON gateway (keys and values base64),
with httpx: the runner needs put and delete, nothing more.

`put_record` writes, by default, the shape this repository's workers register (see
`docs/discovery-and-drain.md`): `id`, `url`, `model`, `role`, `dp_size`, `disagg_meta`
for a prefill, and `status: DRAINING` while draining. A plane whose router reads another
shape passes its own `shape` (a function of the worker and its status), or writes any
key and value with `put_value` / `delete_key`.
"""

from __future__ import annotations

import base64
import json
import os
import platform
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import trio

from conformance.fleet import RunningWorker
from conformance.processes import ProcessFailed, free_port
from conformance.sidecars import Sidecars

ETCD_BINARY = "etcd"
READY_TIMEOUT_S = 20.0
# etcd 3.4 refuses architectures it does not list unless this names the running one.
_GOARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
}
URL_KEY = "etcd_url"
PREFIX_KEY = "etcd_prefix"
DEFAULT_PREFIX = "/conformance/workers/"


def etcd_environment() -> dict[str, str | None]:
    """Variables etcd needs; inherited ETCD_* ones (unset here: None) would silently
    override its flags."""
    env: dict[str, str | None] = {key: None for key in os.environ if key.startswith("ETCD_")}
    env["ETCD_UNSUPPORTED_ARCH"] = _GOARCH.get(platform.machine().lower(), "")
    return env


async def start_etcd(sidecars: Sidecars, prefix: str = DEFAULT_PREFIX) -> str:
    """Start etcd as the sidecar `etcd`; its client URL once it answers `/health`.

    Also stores the URL and `prefix` in `sidecars.values` for the plane's command line.
    """
    client_url = f"http://127.0.0.1:{free_port()}"
    peer_url = f"http://127.0.0.1:{free_port()}"
    argv = [
        ETCD_BINARY,
        "--name",
        "conformance",
        "--data-dir",
        str(sidecars.workdir / "etcd-data"),
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"conformance={peer_url}",
        "--experimental-watch-progress-notify-interval",
        "1s",
    ]
    child = await sidecars.start(argv, "etcd", env=etcd_environment())
    with trio.move_on_after(READY_TIMEOUT_S):
        async with httpx.AsyncClient(trust_env=False) as client:
            while not child.exited:
                try:
                    response = await client.get(client_url + "/health", timeout=1.0)
                    if response.status_code == 200 and response.json().get("health") in (
                        "true",
                        True,
                    ):
                        sidecars.values[URL_KEY] = client_url
                        sidecars.values[PREFIX_KEY] = prefix
                        return client_url
                except (httpx.HTTPError, ValueError):
                    pass
                await trio.sleep(0.05)
    raise ProcessFailed(
        f"etcd did not become healthy within {READY_TIMEOUT_S:g}s:\n{child.output.tail()}"
    )


# A record's shape: the worker and its status (`active`, `draining`, `not_ready`) to the
# JSON object (or the exact text) stored under its key.
RecordShape = Callable[[RunningWorker, str], Mapping[str, Any] | str]


def record(worker: RunningWorker, status: str) -> dict[str, Any]:
    """The worker's record as its own registration would write it."""
    spec = worker.spec
    out: dict[str, Any] = {
        "id": spec.name,
        "url": worker.url,
        "model": [spec.model],
        "role": spec.role,
        "engine": "sglang",
        "dp_size": spec.dp_size,
    }
    if spec.role == "prefill" and worker.bootstrap_port is not None:
        out["disagg_meta"] = {
            "protocol": "mooncake",
            "params": {"bootstrap_addr": f"127.0.0.1:{worker.bootstrap_port}"},
        }
    if status == "draining":
        out["status"] = "DRAINING"
    return out


def record_key(sidecars: Sidecars, worker: RunningWorker) -> str:
    """Where a worker's record lives: the prefix `start_etcd` was given, then its name."""
    return str(sidecars.values[PREFIX_KEY]) + worker.spec.name


async def put_record(
    client: httpx.AsyncClient,
    sidecars: Sidecars,
    worker: RunningWorker,
    status: str,
    shape: RecordShape = record,
) -> None:
    """Write the worker's record, shaped by `shape` (default: this repository's), under
    `record_key`."""
    value = shape(worker, status)
    text = value if isinstance(value, str) else json.dumps(dict(value))
    await put_value(client, sidecars, record_key(sidecars, worker), text)


async def delete_record(
    client: httpx.AsyncClient, sidecars: Sidecars, worker: RunningWorker
) -> None:
    await delete_key(client, sidecars, record_key(sidecars, worker))


async def put_value(client: httpx.AsyncClient, sidecars: Sidecars, key: str, value: str) -> None:
    """Store `value` under `key` in the case's etcd (no lease: the case ends with it).
    ProcessFailed when etcd does not take it."""
    await _call(client, sidecars, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)})


async def delete_key(client: httpx.AsyncClient, sidecars: Sidecars, key: str) -> None:
    """Delete `key` from the case's etcd (a missing key is no error)."""
    await _call(client, sidecars, "/v3/kv/deleterange", {"key": _b64(key)})


async def _call(
    client: httpx.AsyncClient, sidecars: Sidecars, path: str, payload: dict[str, str]
) -> None:
    url = sidecars.values[URL_KEY] + path
    try:
        response = await client.post(url, json=payload, timeout=5.0)
    except httpx.HTTPError as exc:
        raise ProcessFailed(f"etcd {path}: {exc!r}") from None
    if response.status_code != 200:
        raise ProcessFailed(f"etcd {path}: {response.status_code} {response.text[:200]}")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()

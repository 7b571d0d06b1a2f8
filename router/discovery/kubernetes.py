"""Kubernetes discovery: list the Pods of each selector, then watch them.

Per selector: list (the fleet becomes what the listing says), then watch from the list's
`resourceVersion` with `allowWatchBookmarks`, so a quiet watch still learns a recent
version to resume from. The API server ends a watch after `timeoutSeconds`: it is resumed
from the last version seen, at once. A watch that breaks is resumed the same way, with
backoff; a 410 Gone (an HTTP 410, or an `ERROR` event carrying one) means that version
is compacted away: relist. While the API server cannot be reached the last fleet stays,
`/health` says so and `router_discovery_up` is 0: a lost API server never empties the
fleet.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import trio

from router.discovery import DiscoveryHealth
from router.discovery.kube_config import KubeConfigError, KubeConnection, load_kube_connection
from router.discovery.kube_pods import PodMirror, PodSource
from router.fleet.registry import Fleet
from router.http.backoff import Backoff
from router.http.capped_reads import StreamTooLarge, close_stream, read_capped
from router.observability.metrics import DiscoveryMetrics

log = logging.getLogger("router.discovery.kubernetes")

MAX_LIST_BYTES = 64 * 1024 * 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024
MAX_STATUS_BYTES = 64 * 1024


class KubeUnavailable(Exception):
    """The API server did not answer as it should; resume after a backoff."""


class WatchBroken(KubeUnavailable):
    """A watch that was open broke; alone it proves nothing about the API server (the
    next request decides)."""


class KubeGone(Exception):
    """410 Gone: the version asked for is compacted away; relist."""


@dataclass(frozen=True, slots=True)
class KubeTiming:
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    request_timeout_s: float = 10.0
    watch_timeout_s: int = 290
    """`timeoutSeconds` of a watch: the server ends it then, and it is resumed at once."""
    watch_read_margin_s: float = 30.0
    """Silence beyond `watch_timeout_s` + this is taken for a half-open connection."""


@dataclass(frozen=True, slots=True)
class KubeDiscoverySettings:
    sources: tuple[PodSource, ...]
    namespace: str | None
    """None: the namespace the connection names (the router's own Pod's), else default."""
    port: int = 8000
    kubeconfig: str | None = None
    timing: KubeTiming = KubeTiming()


def _status_text(body: bytes) -> str:
    try:
        status = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace")
    if isinstance(status, dict):
        return f"{status.get('reason', '')}: {status.get('message', '')}".strip(": ")
    return ""


class PodsApi:
    """The two calls discovery makes on one namespace: list and watch Pods."""

    def __init__(self, http: httpx.AsyncClient, namespace: str, timing: KubeTiming) -> None:
        self._http = http
        self._path = f"/api/v1/namespaces/{namespace}/pods"
        self._timing = timing

    async def list(self, source: PodSource) -> tuple[list[Any], str]:
        """The Pods matching `source` and the version the listing was taken at."""
        params = {"labelSelector": str(source.selector)}
        try:
            async with self._http.stream("GET", self._path, params=params) as response:
                limit = MAX_LIST_BYTES if response.status_code == 200 else MAX_STATUS_BYTES
                body = await read_capped(response, limit)
        except httpx.HTTPError as exc:
            raise KubeUnavailable(f"list pods: {type(exc).__name__}: {exc}") from exc
        except StreamTooLarge as exc:
            raise KubeUnavailable(f"list pods: {exc}") from None
        if response.status_code != 200:
            raise KubeUnavailable(f"list pods: HTTP {response.status_code} {_status_text(body)}")
        try:
            listing = orjson.loads(body)
            items, version = listing["items"] or [], listing["metadata"]["resourceVersion"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise KubeUnavailable(f"list pods: not a PodList ({exc!r})") from None
        if not isinstance(items, list) or not isinstance(version, str) or not version:
            raise KubeUnavailable("list pods: not a PodList")
        return items, version

    @asynccontextmanager
    async def watch(
        self, source: PodSource, version: str
    ) -> AsyncIterator[AsyncGenerator[dict[str, Any], None]]:
        """The watch events after `version`, one dict per line; the iterator ends when the
        server ends the watch. Raises KubeGone for a 410, KubeUnavailable otherwise.

        Cancellation or exit: the HTTP stream is closed, which ends the watch.
        """
        timing = self._timing
        params = {
            "watch": "1",
            "labelSelector": str(source.selector),
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timing.watch_timeout_s),
        }
        timeout = httpx.Timeout(
            timing.request_timeout_s, read=timing.watch_timeout_s + timing.watch_read_margin_s
        )
        request = self._http.build_request("GET", self._path, params=params, timeout=timeout)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise KubeUnavailable(f"watch pods: {type(exc).__name__}: {exc}") from exc
        chunks = response.aiter_bytes()
        try:
            if response.status_code != 200:
                try:
                    body = await read_capped(response, MAX_STATUS_BYTES)
                except (httpx.HTTPError, StreamTooLarge):
                    body = b""
                if response.status_code == 410:
                    raise KubeGone(_status_text(body))
                raise KubeUnavailable(
                    f"watch pods: HTTP {response.status_code} {_status_text(body)}"
                )
            yield self._events(chunks)
        finally:
            await close_stream(response, chunks)

    async def _events(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[dict[str, Any], None]:
        """One event per line; a line longer than MAX_EVENT_BYTES is refused before it is
        all held (httpx's own line reader has no bound)."""
        pending = bytearray()
        lines: list[bytearray] = []
        while True:
            if not lines:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as exc:
                    raise KubeUnavailable(f"watch pods: {type(exc).__name__}: {exc}") from exc
                pending += chunk
                *lines, rest = pending.split(b"\n")
                pending = bytearray(rest)
                if len(pending) > MAX_EVENT_BYTES:
                    raise KubeUnavailable(
                        f"watch pods: an event larger than {MAX_EVENT_BYTES} bytes"
                    )
                continue
            line = lines.pop(0)
            if not line.strip():
                continue
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise KubeUnavailable(
                    f"watch pods: a line that is not JSON: {bytes(line[:100])!r}"
                ) from None
            if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
                raise KubeUnavailable(f"watch pods: not a watch event: {bytes(line[:100])!r}")
            if event.get("type") == "ERROR":
                status = event["object"]
                text = f"{status.get('reason', '')}: {status.get('message', '')}"
                if status.get("code") == 410:
                    raise KubeGone(text)
                raise KubeUnavailable(f"watch pods: ERROR event {status.get('code')} {text}")
            yield event


class _Link:
    """What `/health` and `router_discovery_up` say: up only while every watch is."""

    def __init__(
        self, health: DiscoveryHealth, metrics: DiscoveryMetrics, fleet: Fleet, server: str
    ) -> None:
        self._health = health
        self._metrics = metrics
        self._fleet = fleet
        self._server = server
        self._down: dict[str, str] = {}
        self._watching: dict[str, str] = {}

    def up(self, source: PodSource, detail: str) -> None:
        key = str(source.selector)
        if self._down.pop(key, None) is not None:
            log.info("Kubernetes API answers again (%s)", key)
        self._watching[key] = detail
        self._show()

    def down(self, source: PodSource, reason: str) -> None:
        key = str(source.selector)
        if key not in self._down:
            log.warning(
                "Kubernetes API %s unreachable for %s (%s); routing to the last known fleet "
                "of %d worker(s), retrying with backoff",
                self._server,
                key,
                reason,
                len(self._fleet),
            )
        self._down[key] = reason
        self._show()

    def _show(self) -> None:
        if self._down:
            reasons = "; ".join(f"{key}: {why}" for key, why in self._down.items())
            self._health.up = False
            self._health.detail = (
                f"Kubernetes API {self._server} unreachable ({reasons}); routing to the last "
                f"known fleet of {len(self._fleet)} worker(s)"
            )
            self._metrics.report_up(False)
        else:
            self._health.up = True
            self._health.detail = "; ".join(self._watching.values())
            self._metrics.report_up(True)


async def serve_kubernetes_discovery(
    settings: KubeDiscoverySettings,
    fleet: Fleet,
    metrics: DiscoveryMetrics,
    *,
    connection: KubeConnection | None = None,
    task_status: trio.TaskStatus[DiscoveryHealth] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Follow the Pods of every selector until cancelled.

    Ready once every selector was listed once or failed its first try (then with
    `up=False` and whatever fleet there is). Raises KubeConfigError at once when no
    connection can be configured.
    Cancellation: the watch streams are closed; the fleet keeps its last state.
    """
    connection = connection or load_kube_connection(settings.kubeconfig)
    namespace = settings.namespace or connection.namespace or "default"
    health = DiscoveryHealth(
        source="kubernetes", up=False, detail=f"connecting to {connection.server}"
    )
    metrics.report_up(False)
    link = _Link(health, metrics, fleet, connection.server)
    mirror = PodMirror(fleet, settings.sources, settings.port)
    log.info(
        "Kubernetes discovery: %s, namespace %s, selectors %s",
        connection.source,
        namespace,
        ", ".join(f"{s.role.value}: {s.selector}" for s in settings.sources),
    )
    async with (
        httpx.AsyncClient(
            base_url=connection.server,
            verify=connection.verify,
            auth=connection.auth,
            timeout=settings.timing.request_timeout_s,
        ) as http,
        trio.open_nursery() as nursery,
    ):
        api = PodsApi(http, namespace, settings.timing)
        for source in settings.sources:
            follower = _Follower(api, source, mirror, link, metrics, settings.timing)
            await nursery.start(follower.run)
        task_status.started(health)


class _Follower:
    """The list-then-watch loop of one selector."""

    def __init__(
        self,
        api: PodsApi,
        source: PodSource,
        mirror: PodMirror,
        link: _Link,
        metrics: DiscoveryMetrics,
        timing: KubeTiming,
    ) -> None:
        self._api = api
        self._source = source
        self._mirror = mirror
        self._link = link
        self._metrics = metrics
        self._backoff = Backoff(timing.backoff_initial_s, timing.backoff_max_s)
        self._quiet_s = timing.watch_timeout_s / 2
        self.version: str | None = None
        """The version the fleet reflects; None until listed (or after a 410)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        reported = False
        while True:
            try:
                if self.version is None:
                    pods, version = await self._api.list(self._source)
                    self._mirror.relist(self._source, pods)
                    self._metrics.count_relist()
                    self.version = version
                    self._link.up(
                        self._source, f"listed {self._source.selector} at version {version}"
                    )
                    log.info(
                        "listed %d Pod(s) of %s at version %s",
                        len(pods),
                        self._source.selector,
                        version,
                    )
                if not reported:
                    task_status.started()
                    reported = True
                started, events = trio.current_time(), await self._watch()
                if events == 0 and trio.current_time() - started < self._quiet_s:
                    # Ended early with nothing to say: not a failure, but no reason to ask
                    # again at once either (a server that cuts every watch short).
                    await trio.sleep(self._backoff.failure())
            except WatchBroken as exc:
                log.debug(
                    "watch of %s broke (%s); resuming after version %s",
                    self._source.selector,
                    exc,
                    self.version,
                )
                await trio.sleep(self._backoff.failure())
            except KubeGone as exc:
                log.warning(
                    "watch of %s from version %s is gone (%s): relisting",
                    self._source.selector,
                    self.version,
                    exc,
                )
                self.version = None
                # Short the first time; a server that answers 410 to every watch is not
                # relisted in a tight loop.
                await trio.sleep(self._backoff.failure())
            except (KubeUnavailable, KubeConfigError) as exc:
                self._link.down(self._source, str(exc))
                if not reported:
                    task_status.started()
                    reported = True
                await trio.sleep(self._backoff.failure())

    async def _watch(self) -> int:
        """Apply events after `self.version`, advancing it, until the server ends the
        watch; the number of events seen."""
        assert self.version is not None
        count = 0
        async with self._api.watch(self._source, self.version) as events:
            self._link.up(
                self._source, f"watching {self._source.selector} after version {self.version}"
            )
            async with aclosing(events):
                try:
                    async for event in events:
                        count += 1
                        kind, obj = event.get("type"), event["object"]
                        meta = obj.get("metadata")
                        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
                        if kind == "BOOKMARK":
                            self._metrics.count_event("bookmark")
                        elif kind in ("ADDED", "MODIFIED", "DELETED"):
                            self._metrics.count_event(kind.lower())
                            self._mirror.apply(self._source, kind, obj)
                        else:
                            log.warning("ignoring a watch event of type %r", kind)
                        if isinstance(version, str) and version:
                            self.version = version
                        self._backoff.reset()
                except KubeGone:
                    raise
                except KubeUnavailable as exc:
                    raise WatchBroken(str(exc)) from exc
        return count

"""A fake Kubernetes API server for Pods, over real loopback HTTP (trio + h11).

What it serves, shaped like the real API server (and checked against the official
`kubernetes` client in tests/integration/test_fake_kube_api.py):
- `GET /api/v1/namespaces/NS/pods` lists, with `labelSelector` (equality terms `k=v`);
  the list carries the `resourceVersion` it was taken at;
- the same with `watch=1` streams one JSON event per line: `ADDED`, `MODIFIED`,
  `DELETED`, `BOOKMARK` (only with `allowWatchBookmarks=true`), and `ERROR` with a 410
  `Status` when the requested version is older than the compaction window (or, with
  `gone_as_http`, an HTTP 410 answer); `timeoutSeconds` ends the stream;
- `GET .../pods/NAME`, and `DELETE .../pods/NAME` as graceful deletion: it sets
  `deletionTimestamp` (a `MODIFIED` event), then emits `DELETED` after the grace period;
- `POST .../pods` creates a Pod (409 when the name is taken), `PATCH .../pods/NAME/status`
  merges a JSON merge patch into its `status` (lists replaced, as RFC 7386 says), and
  `DELETE` with `gracePeriodSeconds=0` removes a Pod at once, terminating or not: what a
  controller and the kubelet do, for a driver outside the process;
- a bearer token is required (401 `Status` without the right one);
- resource versions only grow, across every object.

Tests drive the Pods directly (`add_pod`, `set_ready`, `begin_deletion`, ...) and can take
the server away (`go_away`) and bring it back on the same port (`serve` again).

`tests/support/fake_kube_api_process.py` runs it as a process of its own.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import orjson
import trio

from tests.support.kube_objects import (
    make_pod,
    matches_selector,
    merge_status_patch,
    now_rfc3339,
    parse_selector,
    status_object,
)

__all__ = ["FakeKubeApi", "make_pod"]

MAX_HEAD = 64 * 1024


@dataclass(slots=True)
class _Change:
    version: int
    kind: str  # ADDED, MODIFIED, DELETED
    before: dict[str, Any] | None
    after: dict[str, Any]


@dataclass
class FakeKubeApi:
    """The API server's state (Pods, versions, history) and its HTTP front."""

    token: str = "test-token"
    compaction_window: int = 10_000
    """Changes kept for watches; a watch from an older version gets a 410."""
    gone_as_http: bool = False
    port: int = 0
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    version: int = 100
    requests: list[tuple[str, str]] = field(default_factory=list)
    """(method, path?query) of every request, for tests that count calls."""
    watches_open: int = 0
    unauthorized: int = 0
    """Requests answered 401."""
    _history: list[_Change] = field(default_factory=list)
    _oldest: int = 100
    _changed: trio.Event = field(default_factory=trio.Event)
    _scope: trio.CancelScope | None = None
    _bookmarks: int = 0
    _watch_epoch: int = 0

    # ---- state changes, as the control plane and kubelet would make them ----

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if key in self.pods:
            raise ValueError(f"pod {key} exists")
        return self._record("ADDED", None, copy.deepcopy(pod))

    def update_pod(self, namespace: str, name: str, **changes: Any) -> dict[str, Any]:
        """MODIFIED with `ready=`, `phase=`, `ip=`, `labels=`, `annotations=` changed."""
        before = self.pods[(namespace, name)]
        after = copy.deepcopy(before)
        if "ready" in changes:
            after["status"]["conditions"] = [
                {"type": "Ready", "status": "True" if changes.pop("ready") else "False"}
            ]
        if "phase" in changes:
            after["status"]["phase"] = changes.pop("phase")
        if "ip" in changes:
            ip = changes.pop("ip")
            if ip is None:
                after["status"].pop("podIP", None)
            else:
                after["status"]["podIP"] = ip
        for meta in ("labels", "annotations"):
            if meta in changes:
                after["metadata"][meta] = dict(changes.pop(meta))
        if changes:
            raise TypeError(f"unknown change(s) {sorted(changes)}")
        return self._record("MODIFIED", before, after)

    def set_ready(self, name: str, ready: bool, namespace: str = "default") -> dict[str, Any]:
        return self.update_pod(namespace, name, ready=ready)

    def begin_deletion(
        self, name: str, grace_s: int = 30, namespace: str = "default"
    ) -> dict[str, Any]:
        """Graceful deletion's first step: `deletionTimestamp` is set (MODIFIED)."""
        before = self.pods[(namespace, name)]
        after = copy.deepcopy(before)
        after["metadata"]["deletionTimestamp"] = now_rfc3339()
        after["metadata"]["deletionGracePeriodSeconds"] = grace_s
        return self._record("MODIFIED", before, after)

    def finish_deletion(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        """The containers exited: the Pod is gone (DELETED). None when already gone."""
        before = self.pods.get((namespace, name))
        if before is None:
            return None
        return self._record("DELETED", before, copy.deepcopy(before))

    def compact(self) -> None:
        """Forget every change so far: a watch from any earlier version gets a 410."""
        self._history.clear()
        self._oldest = self.version

    def _record(
        self, kind: str, before: dict[str, Any] | None, after: dict[str, Any]
    ) -> dict[str, Any]:
        self.version += 1
        after["metadata"]["resourceVersion"] = str(self.version)
        key = (after["metadata"]["namespace"], after["metadata"]["name"])
        if kind == "DELETED":
            del self.pods[key]
        else:
            self.pods[key] = after
        self._history.append(_Change(self.version, kind, before, after))
        if len(self._history) > self.compaction_window:
            dropped = self._history.pop(0)
            self._oldest = dropped.version
        self._changed.set()
        self._changed = trio.Event()
        return after

    # ---- HTTP ----

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def go_away(self) -> None:
        """Stop serving at once: the listener closes and every open stream is cut."""
        if self._scope is not None:
            self._scope.cancel()

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve on 127.0.0.1 (`self.port`, 0 the first time) until `go_away` or cancelled."""
        with trio.CancelScope() as scope:
            self._scope = scope
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            self.port = listeners[0].socket.getsockname()[1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._connection, listeners)
                task_status.started(self.url)
                await trio.sleep_forever()

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        async with stream, trio.open_nursery() as nursery:
            while True:
                request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                keep = await self._answer(stream, conn, request, body, nursery)
                if not keep or conn.our_state is h11.MUST_CLOSE:
                    return
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return None, b""
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            else:  # ConnectionClosed, or a PAUSED state
                return None, b""

    async def _send(self, stream: trio.SocketStream, conn: h11.Connection, event: Any) -> None:
        await stream.send_all(conn.send(event) or b"")

    async def _respond(
        self, stream: trio.SocketStream, conn: h11.Connection, status: int, data: Any
    ) -> None:
        body = orjson.dumps(data)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self._send(stream, conn, h11.Response(status_code=status, headers=headers))
        await self._send(stream, conn, h11.Data(data=body))
        await self._send(stream, conn, h11.EndOfMessage())

    async def _answer(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        request: h11.Request,
        body: bytes,
        nursery: trio.Nursery,
    ) -> bool:
        target = request.target.decode()
        method = request.method.decode()
        self.requests.append((method, target))
        headers = {name.lower(): value for name, value in request.headers}
        if headers.get(b"authorization") != f"Bearer {self.token}".encode():
            self.unauthorized += 1
            await self._respond(
                stream, conn, 401, status_object(401, "Unauthorized", "Unauthorized")
            )
            return True
        split = urlsplit(target)
        query = {key: values[-1] for key, values in parse_qs(split.query).items()}
        parts = split.path.strip("/").split("/")
        if len(parts) < 5 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
            await self._respond(
                stream,
                conn,
                404,
                status_object(404, "NotFound", f"the server could not find {split.path}"),
            )
            return True
        namespace = parts[3]
        name = parts[5] if len(parts) > 5 else None
        if name is None and method == "POST":
            await self._create(stream, conn, namespace, body)
            return True
        if name is None and method == "GET":
            try:
                selector = parse_selector(query.get("labelSelector", ""))
            except ValueError as exc:
                await self._respond(stream, conn, 400, status_object(400, "BadRequest", str(exc)))
                return True
            if query.get("watch") in ("1", "true"):
                await self._watch(stream, conn, namespace, selector, query)
                return False
            await self._respond(stream, conn, 200, self._list(namespace, selector))
            return True
        pod = self.pods.get((namespace, name or ""))
        if pod is None:
            await self._respond(
                stream, conn, 404, status_object(404, "NotFound", f'pods "{name}" not found')
            )
            return True
        if method == "PATCH" and parts[6:] == ["status"]:
            await self._patch_status(stream, conn, namespace, name or "", body)
        elif method == "GET":
            await self._respond(stream, conn, 200, pod)
        elif method == "DELETE":
            options = orjson.loads(body) if body else {}
            grace = int(query.get("gracePeriodSeconds", options.get("gracePeriodSeconds", 30)))
            if grace == 0:
                self.finish_deletion(name or "", namespace)
            elif pod["metadata"].get("deletionTimestamp") is None:
                pod = self.begin_deletion(name or "", grace, namespace)
                nursery.start_soon(self._delete_after, namespace, name or "", grace)
            await self._respond(stream, conn, 200, pod)
        else:
            await self._respond(stream, conn, 405, status_object(405, "MethodNotAllowed", method))
        return True

    async def _create(
        self, stream: trio.SocketStream, conn: h11.Connection, namespace: str, body: bytes
    ) -> None:
        try:
            pod = orjson.loads(body)
            pod["metadata"]["namespace"] = namespace
            answer = (201, self.add_pod({"status": {}, **pod}))
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            answer = (400, status_object(400, "BadRequest", f"not a Pod: {exc}"))
        except ValueError as exc:
            answer = (409, status_object(409, "AlreadyExists", str(exc)))
        await self._respond(stream, conn, *answer)

    async def _patch_status(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        namespace: str,
        name: str,
        body: bytes,
    ) -> None:
        before = self.pods[(namespace, name)]
        try:
            after = merge_status_patch(before, orjson.loads(body))
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            await self._respond(
                stream, conn, 400, status_object(400, "BadRequest", f"not a status patch: {exc}")
            )
            return
        await self._respond(stream, conn, 200, self._record("MODIFIED", before, after))

    async def _delete_after(self, namespace: str, name: str, grace_s: int) -> None:
        await trio.sleep(grace_s)
        self.finish_deletion(name, namespace)

    def _list(self, namespace: str, selector: dict[str, str]) -> dict[str, Any]:
        items = [
            pod
            for (ns, _), pod in sorted(self.pods.items())
            if ns == namespace and matches_selector(pod, selector)
        ]
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }

    def _events_after(
        self, version: int, namespace: str, selector: dict[str, str]
    ) -> Iterable[tuple[str, dict[str, Any]]]:
        """Watch events after `version` as this watcher sees them: a change that moves a
        Pod into the selector is ADDED, out of it DELETED."""
        for change in self._history:
            if change.version <= version or change.after["metadata"]["namespace"] != namespace:
                continue
            was, now = (
                matches_selector(change.before, selector),
                matches_selector(change.after, selector),
            )
            if change.kind == "DELETED":
                if was:
                    yield "DELETED", change.after
            elif was and now:
                yield "MODIFIED", change.after
            elif now:
                yield "ADDED", change.after
            elif was:
                yield "DELETED", change.after

    async def _watch(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        namespace: str,
        selector: dict[str, str],
        query: dict[str, str],
    ) -> None:
        raw_version = query.get("resourceVersion", "")
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        timeout_s = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        start = int(raw_version) if raw_version not in ("", "0") else None
        if start is not None and start < self._oldest:
            gone = status_object(
                410, "Expired", f"too old resource version: {start} ({self._oldest})"
            )
            if self.gone_as_http:
                await self._respond(stream, conn, 410, gone)
                return
        else:
            gone = None
        headers = [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]
        await self._send(stream, conn, h11.Response(status_code=200, headers=headers))

        async def line(kind: str, obj: dict[str, Any]) -> None:
            await self._send(
                stream, conn, h11.Data(data=orjson.dumps({"type": kind, "object": obj}) + b"\n")
            )

        self.watches_open += 1
        try:
            with trio.move_on_after(timeout_s if timeout_s is not None else float("inf")):
                if gone is not None:
                    await line("ERROR", gone)
                    await self._send(stream, conn, h11.EndOfMessage())
                    return
                if start is None:  # "from now": the current state as ADDED events first
                    for (ns, _), pod in sorted(self.pods.items()):
                        if ns == namespace and matches_selector(pod, selector):
                            await line("ADDED", pod)
                    start = self.version
                seen = start
                bookmarks_sent = self._bookmarks
                epoch = self._watch_epoch
                while epoch == self._watch_epoch:
                    # Taken in one synchronous step: a change made while the lines are
                    # being sent is newer than `seen` and sets `changed`.
                    changed = self._changed
                    events = list(self._events_after(seen, namespace, selector))
                    seen = self.version
                    for kind, obj in events:
                        await line(kind, obj)
                    if bookmarks and bookmarks_sent < self._bookmarks:
                        bookmarks_sent = self._bookmarks
                        await line(
                            "BOOKMARK",
                            {
                                "kind": "Pod",
                                "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(seen)},
                            },
                        )
                    await changed.wait()
            await self._send(stream, conn, h11.EndOfMessage())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            self.watches_open -= 1

    def end_watches(self) -> None:
        """End every open watch cleanly, as the server does when `timeoutSeconds` is up."""
        self._watch_epoch += 1
        self._changed.set()
        self._changed = trio.Event()

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current version on every watch that asked for them."""
        self._bookmarks += 1
        self._changed.set()
        self._changed = trio.Event()

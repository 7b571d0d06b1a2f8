"""A small trio-native etcd v3 client over etcd's JSON gateway (`/v3/...`, etcd 3.4+).

It covers what discovery and registration need: lease grant/keepalive/revoke, put with a
lease, delete, prefix range, compaction and a streaming prefix watch from a revision. Retry
policy is the caller's: every failure that a later attempt may cure raises
`EtcdUnavailable`, a watch whose start revision is gone raises `WatchCompacted`.

Gateway facts this module absorbs: keys and values travel as base64, 64-bit integers as
strings, fields holding their zero value are left out (a PUT watch event has no `type`, an
expired lease's keepalive answer has no `TTL`), and streaming answers are newline-delimited
`{"result": ...}` or `{"error": ...}` objects.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson
import trio

# gRPC status NOT_FOUND, as the gateway reports it in an error body.
_GRPC_NOT_FOUND = 5
_DRAIN_BACKSTOP_S = 1.0


class EtcdError(Exception):
    """etcd refused a request, or answered something this client cannot use."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EtcdUnavailable(EtcdError):
    """etcd could not be reached or answered in time; the same request may succeed later."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: relist, then watch from the new head."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(
            f"watch start revision was compacted (compact_revision={compact_revision})"
        )
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["PUT", "DELETE"]
    key: str
    value: bytes
    mod_revision: int


@dataclass(frozen=True, slots=True)
class RangeResult:
    kvs: list[KeyValue]
    revision: int


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive `range_end` that selects every key starting with `prefix`.

    Trailing 0xff bytes cannot be incremented, so they are dropped first; a prefix with
    nothing left (empty, or all 0xff) selects every key from it onward, which etcd spells
    `\\x00`.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\x00"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _key(encoded: str | None) -> str:
    # A foreign non-UTF-8 key under our prefix must not stop discovery; it simply never
    # parses as a worker record.
    return _unb64(encoded).decode("utf-8", "backslashreplace")


def _revision(body: dict[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


def _error_text(content: bytes, status: int) -> tuple[str, int | None]:
    """etcd's own message and gRPC code from an error body, when it has them."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return f"HTTP {status}: {content[:200]!r}", None
    if not isinstance(body, dict):
        return f"HTTP {status}: {body!r}", None
    error = body.get("error")
    if isinstance(error, dict):  # the shape of in-stream errors
        return f"HTTP {status}: {error.get('message', error)}", error.get("grpc_code")
    code = body.get("code")
    return f"HTTP {status}: {body.get('message') or error or body}", code


def _refusal(path: str, status: int, content: bytes) -> EtcdError:
    """The error a non-200 answer means: 408 and 5xx may pass, anything else will not."""
    message, _ = _error_text(content, status)
    error = EtcdUnavailable if status == 408 or status >= 500 else EtcdError
    return error(f"etcd {path}: {message}")


def _parse_object(line: bytes | str, what: str) -> dict[str, Any]:
    try:
        body = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise EtcdUnavailable(f"etcd {what}: unreadable answer {line[:200]!r}") from exc
    if not isinstance(body, dict):
        raise EtcdUnavailable(f"etcd {what}: unexpected answer {body!r}")
    return body


def _watch_event(raw: dict[str, Any]) -> WatchEvent:
    kv = raw.get("kv", {})
    return WatchEvent(
        type="DELETE" if raw.get("type") == "DELETE" else "PUT",
        key=_key(kv.get("key")),
        value=_unb64(kv.get("value")),
        mod_revision=int(kv.get("mod_revision", 0)),
    )


async def _drain_closed(lines: AsyncIterator[str]) -> None:
    """Run a closed response's line iterator to its end, discarding what it says.

    httpx reads through a stack of nested async generators, and closing only the outer one
    leaves the inner ones suspended for the garbage collector, which trio reports as a
    leak. Once the connection is closed the innermost read fails at once, and that error
    unwinds every layer. The deadline is only a backstop: its cancellation unwinds the
    layers just the same.
    """
    with trio.move_on_after(_DRAIN_BACKSTOP_S, shield=True):
        try:
            async for _ in lines:
                pass
        except (httpx.HTTPError, httpx.StreamError):
            pass  # the expected end of a closed stream


class EtcdClient:
    """One etcd endpoint reached through its JSON gateway.

    Each unary call is bounded by `timeout_s` per connect/read/write; the watch stream's
    read bound is its own `idle_timeout_s`. A cancelled call leaves no connection half
    read, but what it asked for may or may not have happened in etcd (a put may land).
    """

    def __init__(
        self, endpoint: str, *, http: httpx.AsyncClient | None = None, timeout_s: float = 5.0
    ) -> None:
        self._base = endpoint.rstrip("/")
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient()
        self._timeout_s = timeout_s

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            await self._http.aclose()

    async def _post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        try:
            response = await self._http.post(
                self._base + path,
                content=orjson.dumps(payload),
                headers={"content-type": "application/json"},
                timeout=self._timeout_s,
            )
        except httpx.TransportError as exc:
            raise EtcdUnavailable(f"etcd {path}: {type(exc).__name__}: {exc}") from exc
        return response.status_code, response.content

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST `payload`; the decoded answer, or the error that a non-200 status means."""
        status, content = await self._post(path, payload)
        if status != 200:
            raise _refusal(path, status, content)
        return _parse_object(content, path)

    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease id; etcd may round `ttl_s` up to its minimum TTL."""
        body = await self._call("/v3/lease/grant", {"TTL": ttl_s, "ID": 0})
        if body.get("error"):
            raise EtcdError(f"etcd /v3/lease/grant: {body['error']}")
        return int(body["ID"])

    async def keepalive_once(self, lease_id: int) -> int | None:
        """Refresh the lease; its remaining TTL, or None when the lease no longer exists."""
        path = "/v3/lease/keepalive"
        status, content = await self._post(path, {"ID": str(lease_id)})
        if status != 200:
            raise _refusal(path, status, content)
        # A stream of one object per request message; we sent one.
        line = content.strip().split(b"\n", 1)[0]
        body = _parse_object(line, path)
        if "error" in body:
            message, _ = _error_text(line, status)
            raise EtcdUnavailable(f"etcd {path}: {message}")
        ttl = int(body.get("result", {}).get("TTL", 0))
        return ttl if ttl > 0 else None

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease and delete its keys; a lease already gone counts as revoked."""
        path = "/v3/lease/revoke"
        status, content = await self._post(path, {"ID": str(lease_id)})
        if status == 200 or _error_text(content, status)[1] == _GRPC_NOT_FOUND:
            return
        raise _refusal(path, status, content)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write `key`, attached to `lease` when non-zero; the revision of the write."""
        payload = {"key": _b64(key.encode()), "value": _b64(value), "lease": str(lease)}
        return _revision(await self._call("/v3/kv/put", payload))

    async def delete(self, key: str) -> int:
        """Delete `key` (absent is fine); the store revision after the call."""
        return _revision(await self._call("/v3/kv/deleterange", {"key": _b64(key.encode())}))

    async def get_prefix(self, prefix: str) -> RangeResult:
        """Every key under `prefix`, with the store revision the listing was taken at."""
        start = prefix.encode() or b"\x00"
        payload = {"key": _b64(start), "range_end": _b64(prefix_range_end(prefix.encode()))}
        body = await self._call("/v3/kv/range", payload)
        kvs = [
            KeyValue(
                key=_key(kv.get("key")),
                value=_unb64(kv.get("value")),
                mod_revision=int(kv.get("mod_revision", 0)),
                lease=int(kv.get("lease", 0)),
            )
            for kv in body.get("kvs", [])
        ]
        return RangeResult(kvs=kvs, revision=_revision(body))

    async def compact(self, revision: int) -> None:
        """Drop history before `revision`; returns once the compaction is applied on disk.

        Compacting at or below an earlier compaction is refused by etcd (EtcdError).
        """
        await self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    async def watch_prefix(
        self,
        prefix: str,
        start_revision: int,
        *,
        progress_notify: bool = True,
        idle_timeout_s: float = 30.0,
        on_alive: Callable[[], None] | None = None,
    ) -> AsyncGenerator[list[WatchEvent], None]:
        """Batches of changes under `prefix` from `start_revision` on, in revision order.

        Never ends normally: a stream that stops, an in-stream error, HTTP 408/5xx, a
        connection error or `idle_timeout_s` without a single byte (a half-open
        connection; progress notifications keep a quiet watch talking) raise
        `EtcdUnavailable`, and the caller resumes from the last revision it saw. A
        compacted start revision raises `WatchCompacted`. `on_alive` is called for every
        message etcd sends on the stream (events, the `created` answer, progress
        notifications): each proves etcd is alive, quiet fleet or not.

        Use it under `contextlib.aclosing` so the stream is closed when the caller stops
        early. Cancellation or close: the HTTP stream is closed, which ends the watch on
        the server; nothing else is left behind.
        """
        path = "/v3/watch"
        key = prefix.encode() or b"\x00"
        create = {
            "key": _b64(key),
            "range_end": _b64(prefix_range_end(prefix.encode())),
            "start_revision": str(start_revision),
            "progress_notify": progress_notify,
        }
        request = self._http.build_request(
            "POST",
            self._base + path,
            content=orjson.dumps({"create_request": create}),
            headers={"content-type": "application/json"},
            timeout=httpx.Timeout(self._timeout_s, read=idle_timeout_s),
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise EtcdUnavailable(f"etcd {path}: {type(exc).__name__}: {exc}") from exc
        lines = response.aiter_lines()
        try:
            if response.status_code != 200:
                try:
                    content = await response.aread()
                except httpx.TransportError:
                    content = b""
                raise _refusal(path, response.status_code, content)
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    raise EtcdUnavailable(f"etcd {path}: stream ended") from None
                except httpx.TransportError as exc:
                    raise EtcdUnavailable(f"etcd {path}: {type(exc).__name__}: {exc}") from exc
                if not line.strip():
                    continue
                body = _parse_object(line, path)
                if "error" in body:
                    message, _ = _error_text(line.encode(), 200)
                    raise EtcdUnavailable(f"etcd {path}: {message}")
                if on_alive is not None:
                    on_alive()
                result = body.get("result", {})
                if result.get("canceled"):
                    compact_revision = int(result.get("compact_revision", 0))
                    if compact_revision > 0:
                        raise WatchCompacted(compact_revision)
                    reason = result.get("cancel_reason", "no reason given")
                    raise EtcdUnavailable(f"etcd {path}: watch canceled: {reason}")
                # `created` and progress notifications carry no events; reading them
                # is what keeps the idle timeout from firing.
                events = result.get("events")
                if events:
                    yield [_watch_event(raw) for raw in events]
        finally:
            await response.aclose()
            await _drain_closed(lines)


@asynccontextmanager
async def open_etcd_client(endpoint: str, **kw: Any) -> AsyncIterator[EtcdClient]:
    """An `EtcdClient` for `endpoint`, closed on exit (see `EtcdClient` for `kw`)."""
    client = EtcdClient(endpoint, **kw)
    try:
        yield client
    finally:
        await client.aclose()

"""The etcd client against a real etcd member, plus scripted servers for the failure shapes
etcd shows only while shutting down (HTTP 503, HTTP 408, an in-stream error) and for a
silent, half-open stream."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial

import httpx
import pytest
import trio

from router.discovery.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    WatchCompacted,
    WatchEvent,
    open_etcd_client,
    prefix_range_end,
)
from tests.support.etcd_server import (
    EtcdServer,
)
from tests.support.ports import free_port


async def next_events(watch: AsyncIterator[list[WatchEvent]], count: int) -> list[WatchEvent]:
    """Exactly the next `count` events, across as many batches as etcd sends them in."""
    events: list[WatchEvent] = []
    while len(events) < count:
        events.extend(await anext(watch))
    assert len(events) == count
    return events


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"/router/workers/") == b"/router/workers0"
    assert prefix_range_end(b"a") == b"b"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"a\x01\xff\xff") == b"a\x02"
    assert prefix_range_end(b"\xff\xff") == b"\x00"
    assert prefix_range_end(b"") == b"\x00"


@pytest.mark.etcd
async def test_put_and_get_prefix_round_trip_keys_values_and_revisions(etcd: EtcdServer) -> None:
    with trio.fail_after(10):
        async with open_etcd_client(etcd.url) as client:
            binary = bytes(range(256))
            unicode_value = "héllo ✓ 世界".encode()
            rev_bin = await client.put("/t/bin", binary)
            rev_uni = await client.put("/t/ключ", unicode_value)
            rev_empty = await client.put("/t/empty", b"")
            await client.put("/t0", b"outside: shares the prefix bytes but not the slash")
            await client.put("/s/x", b"outside: sorts before the prefix")
            assert rev_bin < rev_uni < rev_empty

            listing = await client.get_prefix("/t/")
            assert [(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in listing.kvs] == [
                ("/t/bin", binary, rev_bin, 0),
                ("/t/empty", b"", rev_empty, 0),
                ("/t/ключ", unicode_value, rev_uni, 0),
            ]
            assert all(type(kv.mod_revision) is int for kv in listing.kvs)
            assert listing.revision == rev_empty + 2

            rev_del = await client.delete("/t/bin")
            assert rev_del == listing.revision + 1
            assert await client.delete("/t/bin") == rev_del  # absent: no new revision
            after = await client.get_prefix("/t/")
            assert [kv.key for kv in after.kvs] == ["/t/empty", "/t/ключ"]
            assert after.revision == rev_del
            everything = await client.get_prefix("")
            assert len(everything.kvs) == 4


@pytest.mark.etcd
async def test_lease_keeps_key_until_ttl_expiry_then_keepalive_says_gone(etcd: EtcdServer) -> None:
    with trio.fail_after(15):
        async with open_etcd_client(etcd.url) as client:
            lease = await client.grant_lease(1)
            rev = await client.put("/l/w1", b"{}", lease=lease)
            [kv] = (await client.get_prefix("/l/")).kvs
            assert kv.lease == lease
            ttl = await client.keepalive_once(lease)
            # etcd rounds a TTL up to its minimum (1.5 x election timeout = 2 s by default).
            assert ttl is not None and 1 <= ttl <= 2

            started = trio.current_time()
            async with aclosing(client.watch_prefix("/l/", rev + 1)) as watch:
                [event] = await next_events(watch, 1)
            waited = trio.current_time() - started
            assert (event.type, event.key, event.value) == ("DELETE", "/l/w1", b"")
            assert 0.5 < waited < 6

            assert (await client.get_prefix("/l/")).kvs == []
            assert await client.keepalive_once(lease) is None
            await client.revoke_lease(lease)  # already expired: still fine


@pytest.mark.etcd
async def test_revoke_deletes_attached_keys_and_is_idempotent(etcd: EtcdServer) -> None:
    with trio.fail_after(10):
        async with open_etcd_client(etcd.url) as client:
            lease = await client.grant_lease(30)
            assert await client.keepalive_once(lease) == 30
            await client.put("/r/a", b"1", lease=lease)
            await client.put("/r/b", b"2", lease=lease)
            await client.put("/r/keep", b"3")
            await client.revoke_lease(lease)
            assert [kv.key for kv in (await client.get_prefix("/r/")).kvs] == ["/r/keep"]
            assert await client.keepalive_once(lease) is None
            await client.revoke_lease(lease)
            with pytest.raises(EtcdError) as info:
                await client.put("/r/c", b"4", lease=lease)
            assert not isinstance(info.value, EtcdUnavailable)
            assert "lease not found" in info.value.message


@pytest.mark.etcd
async def test_watch_replays_from_revision_then_follows_live_writes(etcd: EtcdServer) -> None:
    with trio.fail_after(10):
        async with open_etcd_client(etcd.url) as client:
            r1 = await client.put("/w/a", b"A1")
            r2 = await client.put("/w/b", "β".encode())
            r3 = await client.delete("/w/a")
            async with aclosing(client.watch_prefix("/w/", r1)) as watch:
                replay = await next_events(watch, 3)
                assert replay == [
                    WatchEvent("PUT", "/w/a", b"A1", r1),
                    WatchEvent("PUT", "/w/b", "β".encode(), r2),
                    WatchEvent("DELETE", "/w/a", b"", r3),
                ]
                await client.put("/wx", b"outside the prefix")
                r5 = await client.put("/w/c", b"C")
                assert await next_events(watch, 1) == [WatchEvent("PUT", "/w/c", b"C", r5)]
                assert await etcd.watch_streams() == 1
            await etcd.wait_watch_streams(0)

            # Cancelled while waiting for events: the stream is closed all the same.
            async with aclosing(client.watch_prefix("/w/", r5 + 1)) as watch:
                with trio.move_on_after(0.3) as waiting:
                    await anext(watch)
                assert waiting.cancelled_caught
            await etcd.wait_watch_streams(0)


@pytest.mark.etcd
async def test_watch_from_compacted_revision_raises_with_compact_revision(etcd: EtcdServer) -> None:
    with trio.fail_after(10):
        async with open_etcd_client(etcd.url) as client:
            r1 = await client.put("/c/a", b"1")
            await client.put("/c/a", b"2")
            r3 = await client.put("/c/a", b"3")
            await etcd.compact(r3)

            with pytest.raises(WatchCompacted) as info:
                async with aclosing(client.watch_prefix("/c/", r1)) as watch:
                    await anext(watch)
            assert info.value.compact_revision == r3
            # etcd keeps a canceled watch's stream open; the client must close it.
            await etcd.wait_watch_streams(0)

            async with aclosing(client.watch_prefix("/c/", r3)) as watch:
                assert await next_events(watch, 1) == [WatchEvent("PUT", "/c/a", b"3", r3)]

            with pytest.raises(EtcdError) as refused:
                await client.compact(r1)
            assert not isinstance(refused.value, EtcdUnavailable)
            assert "compacted" in refused.value.message


@pytest.mark.etcd
async def test_watch_fails_promptly_on_etcd_stop_and_resumes_after_restart(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(30):
        async with open_etcd_client(etcd.url) as client:
            r1 = await client.put("/m/a", b"1")
            await client.put("/m/b", b"1")
            last_seen = 0
            with pytest.raises(EtcdUnavailable):
                async with aclosing(client.watch_prefix("/m/", r1)) as watch:
                    for event in await next_events(watch, 2):
                        last_seen = event.mod_revision
                    with trio.fail_after(5):
                        await etcd.stop()
                        await anext(watch)
            assert last_seen == r1 + 1

            with pytest.raises(EtcdUnavailable):
                await client.put("/m/c", b"etcd is down")
            with pytest.raises(EtcdUnavailable):
                async with aclosing(client.watch_prefix("/m/", last_seen + 1)) as watch:
                    await anext(watch)

            await etcd.start()
            assert etcd.starts == 2
            async with open_etcd_client(etcd.url) as writer:
                r_put = await writer.put("/m/c", b"written after restart")
                r_del = await writer.delete("/m/a")
            async with aclosing(client.watch_prefix("/m/", last_seen + 1)) as watch:
                assert await next_events(watch, 2) == [
                    WatchEvent("PUT", "/m/c", b"written after restart", r_put),
                    WatchEvent("DELETE", "/m/a", b"", r_del),
                ]
            assert r_put == last_seen + 1


@pytest.mark.etcd
async def test_watch_fails_promptly_when_etcd_is_killed(etcd: EtcdServer) -> None:
    with trio.fail_after(10):
        async with open_etcd_client(etcd.url) as client:
            r1 = await client.put("/k/a", b"1")
            with pytest.raises(EtcdUnavailable):
                async with aclosing(client.watch_prefix("/k/", r1)) as watch:
                    await next_events(watch, 1)
                    with trio.fail_after(3):
                        await etcd.kill()
                        await anext(watch)


@pytest.mark.etcd
async def test_progress_notifications_keep_a_quiet_watch_past_its_idle_timeout(
    etcd: EtcdServer,
) -> None:
    # etcd runs with a 1 s progress interval; both watches allow 2.5 s of silence.
    idle_timeout_s = 2.5
    write_at_s = 4.0
    outcome: dict[str, float] = {}
    with trio.fail_after(15):
        async with open_etcd_client(etcd.url) as client:
            head = (await client.get_prefix("/q/")).revision
            started = trio.current_time()

            async def watch(progress_notify: bool) -> None:
                name = "notified" if progress_notify else "silent"
                iterator = client.watch_prefix(
                    "/q/",
                    head + 1,
                    progress_notify=progress_notify,
                    idle_timeout_s=idle_timeout_s,
                )
                try:
                    async with aclosing(iterator) as events:
                        [event] = await next_events(events, 1)
                        assert event.key == "/q/late"
                except EtcdUnavailable:
                    name += " failed"
                outcome[name] = trio.current_time() - started

            async def write_late() -> None:
                await trio.sleep(write_at_s)
                await client.put("/q/late", b"x")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, True)
                nursery.start_soon(watch, False)
                nursery.start_soon(write_late)

    assert sorted(outcome) == ["notified", "silent failed"]
    assert write_at_s <= outcome["notified"] < write_at_s + 2
    assert idle_timeout_s <= outcome["silent failed"] < write_at_s


# Scripted servers: the answers etcd gives only while shutting down, and a silent peer.

CREATED = b'{"result":{"header":{"revision":"7"},"created":true}}\n'
IN_STREAM_ERROR = (
    b'{"error":{"grpc_code":1,"http_code":408,'
    b'"message":"grpc: the client connection is closing","http_status":"Request Timeout"}}'
)


def plain(status: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\nConnection: close\r\n\r\n" + body


def chunked(*lines: bytes, end: bool = True) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(line), line) for line in lines)
    return head + chunks + (b"0\r\n\r\n" if end else b"")


@dataclass
class ScriptedServer:
    port: int
    requests: list[bytes] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def read_request(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.search(rb"content-length: *(\d+)", head, re.I)
    while match and len(body) < int(match.group(1)):
        body += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + body


async def serve_scripted(
    answer: bytes | None,
    *,
    hold_open: bool,
    task_status: trio.TaskStatus[ScriptedServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer every request with `answer` (None: nothing at all), then hold or close."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server = ScriptedServer(port=listeners[0].socket.getsockname()[1])

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            server.requests.append(await read_request(stream))
            if answer is not None:
                await stream.send_all(answer)
            if hold_open:
                await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(server)


async def first_watch_error(answer: bytes, *, start_revision: int) -> tuple[EtcdError, list[bytes]]:
    """What a watch of `/x/` from `start_revision` raises against a server that answers
    `answer` and closes, and the requests the server got."""
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_scripted, answer, hold_open=False))
        async with open_etcd_client(server.url) as client:
            with pytest.raises(EtcdError) as info:
                async with aclosing(client.watch_prefix("/x/", start_revision)) as watch:
                    await anext(watch)
        nursery.cancel_scope.cancel()
    return info.value, server.requests


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        pytest.param(
            plain(
                "503 Service Unavailable",
                b'{"error":"etcdserver: server stopped","message":"etcdserver: server stopped","code":14}',
            ),
            "HTTP 503: etcdserver: server stopped",
            id="http-503",
        ),
        pytest.param(
            plain(
                "408 Request Timeout",
                b'{"error":"context canceled","message":"context canceled","code":1}',
            ),
            "HTTP 408: context canceled",
            id="http-408",
        ),
        pytest.param(
            chunked(CREATED, IN_STREAM_ERROR),
            "the client connection is closing",
            id="in-stream-error",
        ),
        pytest.param(chunked(CREATED), "stream ended", id="clean-end-of-stream"),
        pytest.param(chunked(CREATED, b"<html>"), "unreadable answer", id="garbage-line"),
        pytest.param(chunked(CREATED, end=False), "RemoteProtocolError", id="cut-mid-stream"),
    ],
)
async def test_watch_failure_shapes_all_mean_unavailable(answer: bytes, message: str) -> None:
    with trio.fail_after(5):
        error, requests = await first_watch_error(answer, start_revision=5)
    assert isinstance(error, EtcdUnavailable)
    assert message in error.message
    [request] = requests
    assert request.startswith(b"POST /v3/watch HTTP/1.1")
    assert b'"start_revision":"5"' in request
    assert b'"progress_notify":true' in request


async def test_watch_refused_with_a_client_error_is_not_retryable() -> None:
    answer = plain("400 Bad Request", b'{"error":"bad","message":"bad request","code":3}')
    with trio.fail_after(5):
        error, requests = await first_watch_error(answer, start_revision=1)
    assert not isinstance(error, EtcdUnavailable)
    assert error.message == "etcd /v3/watch: HTTP 400: bad request"
    assert len(requests) == 1


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(chunked(CREATED, end=False), id="headers-then-silence"),
        pytest.param(None, id="no-answer-at-all"),
    ],
)
async def test_silent_watch_stream_raises_after_idle_timeout(answer: bytes | None) -> None:
    idle_timeout_s = 0.5
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_scripted, answer, hold_open=True))
            async with open_etcd_client(server.url) as client:
                started = trio.current_time()
                with pytest.raises(EtcdUnavailable) as info:
                    watch = client.watch_prefix("/x/", 1, idle_timeout_s=idle_timeout_s)
                    async with aclosing(watch) as events:
                        await anext(events)
                waited = trio.current_time() - started
            assert "ReadTimeout" in info.value.message
            assert idle_timeout_s <= waited < idle_timeout_s + 1
            assert len(server.requests) == 1
            nursery.cancel_scope.cancel()


async def test_unary_calls_map_5xx_to_unavailable_and_4xx_to_error() -> None:
    unavailable = plain("503 Service Unavailable", b'{"error":"x","message":"stopped","code":14}')
    refused = plain("400 Bad Request", b'{"error":"x","message":"bad key","code":3}')
    keepalive_error = chunked(IN_STREAM_ERROR)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            down = await nursery.start(partial(serve_scripted, unavailable, hold_open=False))
            bad = await nursery.start(partial(serve_scripted, refused, hold_open=False))
            closing = await nursery.start(partial(serve_scripted, keepalive_error, hold_open=False))
            async with open_etcd_client(down.url) as client:
                with pytest.raises(EtcdUnavailable, match="HTTP 503: stopped"):
                    await client.put("/x/a", b"1")
                with pytest.raises(EtcdUnavailable, match="HTTP 503: stopped"):
                    await client.keepalive_once(7)
                with pytest.raises(EtcdUnavailable, match="HTTP 503: stopped"):
                    await client.revoke_lease(7)
            async with open_etcd_client(bad.url) as client:
                with pytest.raises(EtcdError, match="HTTP 400: bad key") as info:
                    await client.get_prefix("/x/")
                assert not isinstance(info.value, EtcdUnavailable)
            async with open_etcd_client(closing.url) as client:
                with pytest.raises(EtcdUnavailable, match="client connection is closing"):
                    await client.keepalive_once(7)
            assert len(closing.requests) == 1
            assert len(down.requests) == 3
            assert [r.split(b" ", 2)[1] for r in down.requests] == [
                b"/v3/kv/put",
                b"/v3/lease/keepalive",
                b"/v3/lease/revoke",
            ]
            assert len(bad.requests) == 1
            nursery.cancel_scope.cancel()


async def test_unreachable_endpoint_is_unavailable() -> None:
    port = free_port()
    with trio.fail_after(5):
        async with open_etcd_client(f"http://127.0.0.1:{port}", timeout_s=1.0) as client:
            with pytest.raises(EtcdUnavailable, match="ConnectError"):
                await client.get_prefix("/x/")
            with pytest.raises(EtcdUnavailable, match="ConnectError"):
                await client.grant_lease(10)
            with pytest.raises(EtcdUnavailable, match="ConnectError"):
                async with aclosing(client.watch_prefix("/x/", 1)) as watch:
                    await anext(watch)


async def test_a_shared_http_client_is_left_open() -> None:
    async with httpx.AsyncClient() as http:
        client = EtcdClient("http://127.0.0.1:1/", http=http)
        await client.aclose()
        assert not http.is_closed

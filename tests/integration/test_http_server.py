"""The native HTTP/1.1 server over real loopback sockets."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.lowlevel
import trio.testing

from router.api.errors import answer_refusal
from router.http.server.loop import serve_http
from router.http.server.messages import ClientDisconnected, Handler, Request, ResponseWriter
from router.http.server.settings import ServerSettings
from tests.support.http_client import RawClient

GUARD_S = 5.0
RACE_RUNS = 24

Connect = Callable[[int], Awaitable[RawClient]]
Serve = Callable[..., Awaitable[int]]
ServeClient = Callable[..., Awaitable[RawClient]]
DEFAULT_SETTINGS = ServerSettings()


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Opens test clients on 127.0.0.1 and closes every one of them after the test."""
    opened: list[RawClient] = []

    async def open_client(port: int) -> RawClient:
        client = await RawClient.connect(port)
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        await client.aclose()


@pytest.fixture
def serve(nursery: trio.Nursery) -> Serve:
    """Starts `serve_http` in the test's nursery (answering refusals as the router does) and
    returns its port; the server stops with the test."""

    async def start(handler: Handler, settings: ServerSettings = DEFAULT_SETTINGS) -> int:
        port: int = await nursery.start(
            partial(serve_http, handler, settings, answer_refusal=answer_refusal)
        )
        return port

    return start


@pytest.fixture
def serve_client(connect: Connect, serve: Serve) -> ServeClient:
    """Starts `serve_http` as `serve` does and opens one test client to it."""

    async def start(handler: Handler, settings: ServerSettings = DEFAULT_SETTINGS) -> RawClient:
        return await connect(await serve(handler, settings))

    return start


class Recorder:
    """Answers 200 with `echo:` + the body, and keeps every request it saw."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    async def __call__(self, request: Request, writer: ResponseWriter) -> None:
        self.requests.append(request)
        await writer.respond(200, [(b"content-type", b"text/plain")], b"echo:" + request.body)


class ServerRun:
    """`serve_http` in a task that records when it returned."""

    def __init__(self) -> None:
        self.shutdown = trio.Event()
        self.returned = trio.Event()

    async def __call__(
        self,
        handler: Handler,
        settings: ServerSettings,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await serve_http(
            handler,
            settings,
            shutdown=self.shutdown,
            answer_refusal=answer_refusal,
            task_status=task_status,
        )
        self.returned.set()


async def test_keep_alive_serves_two_requests_on_one_socket(serve_client: ServeClient) -> None:
    handler = Recorder()
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        first = await client.request("POST", "/a", body=b"one")
        second = await client.request("GET", "/b?x=1")
        gone = [r.client_gone for r in handler.requests]
        await client.aclose()
    assert (first.status, first.body) == (200, b"echo:one")
    assert (second.status, second.body) == (200, b"echo:")
    assert first.header(b"connection") is None
    assert first.header(b"server") == b"trio-router"
    assert first.header(b"date") is not None
    assert [(r.method, r.path, r.query) for r in handler.requests] == [
        ("POST", "/a", ""),
        ("GET", "/b", "x=1"),
    ]
    # Same client address and port: both requests rode one socket.
    assert handler.requests[0].client == handler.requests[1].client
    assert gone == [False, False]


async def test_head_request_gets_length_but_no_body_and_keeps_the_connection(
    serve_client: ServeClient,
) -> None:
    handler = Recorder()
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        head = await client.request("HEAD", "/", body=b"")
        after = await client.request("POST", "/", body=b"x")
    assert (head.status, head.header(b"content-length"), head.body) == (200, b"5", b"")
    assert after.body == b"echo:x"
    assert len(handler.requests) == 2


async def test_chunked_request_body_is_joined_and_connection_reused(
    serve_client: ServeClient,
) -> None:
    handler = Recorder()
    head = b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_raw(head + b"5\r\nhello\r\n")
        await trio.testing.wait_all_tasks_blocked()
        await client.send_raw(b"6\r\n world\r\n0\r\n\r\n")
        chunked = await client.read_response("POST")
        again = await client.request("GET", "/again")
    assert (chunked.status, chunked.body) == (200, b"echo:hello world")
    assert again.status == 200
    assert [r.body for r in handler.requests] == [b"hello world", b""]


async def test_expect_100_continue_gets_an_interim_answer(serve_client: ServeClient) -> None:
    handler = Recorder()
    head = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_raw(head)
        interim = await client.stream.receive_some(1024)
        await client.send_raw(b"body")
        response = await client.read_response("POST")
    assert interim.startswith(b"HTTP/1.1 100 ")
    assert response.body == b"echo:body"


@pytest.mark.parametrize("end", [b"\r\n\r\n", b"\r\n"], ids=["whole-head", "unfinished-head"])
async def test_oversize_headers_answered_431_and_closed(
    end: bytes, serve_client: ServeClient
) -> None:
    handler = Recorder()
    settings = ServerSettings(max_header_bytes=1024)
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler, settings)
        await client.send_raw(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 4096 + end)
        response = await client.read_response()
        rest = await client.read_until_eof()
    assert response.status == 431
    assert response.json()["error"]["code"] == "request_headers_too_large"
    assert response.header(b"connection") == b"close"
    assert rest == b""
    assert handler.requests == []


async def test_content_length_over_limit_answered_413_before_the_body_is_sent(
    serve_client: ServeClient,
) -> None:
    handler = Recorder()
    settings = ServerSettings(max_body_bytes=1024)
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler, settings)
        # Only the head goes out: the answer must not wait for the million bytes.
        await client.send_raw(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n")
        response = await client.read_response("POST")
        rest = await client.read_until_eof()
    assert response.status == 413
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("payload_too_large", "invalid_request_error")
    assert "1024" in error["message"]
    assert response.header(b"connection") == b"close"
    assert rest == b""
    assert handler.requests == []


async def test_chunked_body_over_limit_answered_413(serve_client: ServeClient) -> None:
    handler = Recorder()
    settings = ServerSettings(max_body_bytes=1024)
    chunk = b"258\r\n" + b"z" * 600 + b"\r\n"
    head = b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler, settings)
        await client.send_raw(head + chunk + chunk + b"0\r\n\r\n")
        response = await client.read_response("POST")
        rest = await client.read_until_eof()
    assert response.status == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert rest == b""
    assert handler.requests == []


async def test_slow_request_head_cut_off_with_408(serve_client: ServeClient) -> None:
    handler = Recorder()
    settings = ServerSettings(header_timeout_s=0.2)
    with trio.fail_after(GUARD_S):
        # Before the connection: the server's clock for the head starts when it accepts,
        # which may come before this task runs again after connecting.
        start = trio.current_time()
        client = await serve_client(handler, settings)
        await client.send_raw(b"GET / HTTP/1.1\r\nHost: t\r\n")
        response = await client.read_response()
        elapsed = trio.current_time() - start
        rest = await client.read_until_eof()
    assert response.status == 408
    assert response.json()["error"]["code"] == "request_timeout"
    assert elapsed >= 0.2
    assert rest == b""
    assert handler.requests == []


async def test_slow_second_head_uses_header_timeout_not_idle_timeout(
    serve_client: ServeClient,
) -> None:
    handler = Recorder()
    settings = ServerSettings(header_timeout_s=0.2, idle_timeout_s=60.0)
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler, settings)
        first = await client.request("GET", "/")
        await client.send_raw(b"GET /slow HTTP/1.1\r\n")
        second = await client.read_response()
    assert (first.status, second.status) == (200, 408)
    assert len(handler.requests) == 1


async def test_idle_keep_alive_connection_closed_silently(serve_client: ServeClient) -> None:
    handler = Recorder()
    settings = ServerSettings(idle_timeout_s=0.2)
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler, settings)
        start = trio.current_time()
        response = await client.request("GET", "/")
        rest = await client.read_until_eof()
        elapsed = trio.current_time() - start
    assert response.status == 200
    assert rest == b""
    assert elapsed >= 0.2
    assert len(handler.requests) == 1


async def test_malformed_request_answered_400_and_server_keeps_serving(
    connect: Connect, serve: Serve
) -> None:
    handler = Recorder()
    with trio.fail_after(GUARD_S):
        port = await serve(handler)
        bad = await connect(port)
        await bad.send_raw(b"THIS IS NOT HTTP\r\n\r\n")
        refused = await bad.read_response()
        rest = await bad.read_until_eof()
        good = await connect(port)
        served = await good.request("GET", "/")
    assert refused.status == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("malformed HTTP request")
    assert rest == b""
    assert served.status == 200
    assert len(handler.requests) == 1


async def test_streamed_chunks_arrive_one_by_one_and_connection_is_reused(
    serve_client: ServeClient,
) -> None:
    release = trio.Event()
    handled: list[str] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        handled.append(request.path)
        if request.path == "/plain":
            await writer.respond(200, [], b"plain")
            return
        await writer.start(200, [(b"content-type", b"text/event-stream")])
        await writer.write(b"data: one\n\n")
        await release.wait()
        await writer.write(b"data: two\n\n")
        await writer.finish()

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_request("GET", "/stream")
        head = await client.read_head()
        # The handler is still blocked: this chunk went out on its own.
        first = await client.read_chunk()
        release.set()
        second = await client.read_chunk()
        end = await client.read_chunk()
        plain = await client.request("GET", "/plain")
    assert head.status == 200
    assert head.header(b"transfer-encoding") == b"chunked"
    assert (first, second, end) == (b"data: one\n\n", b"data: two\n\n", None)
    assert plain.body == b"plain"
    assert handled == ["/stream", "/plain"]


async def test_client_disconnect_cancels_the_handler(serve_client: ServeClient) -> None:
    started = trio.Event()
    cancelled = trio.Event()
    seen: list[Request] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        seen.append(request)
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_request("POST", "/", body=b"{}")
        await started.wait()
        await client.aclose()
        await cancelled.wait()
    assert len(seen) == 1
    assert seen[0].client_gone is True


async def test_client_closing_after_the_whole_response_does_not_cancel_the_handler(
    serve_client: ServeClient,
) -> None:
    client_closed = trio.Event()
    after_response: list[bool] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        await writer.respond(200, [], b"done")
        await client_closed.wait()
        await trio.lowlevel.checkpoint()  # a cancelled scope would raise here
        after_response.append(request.client_gone)

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        response = await client.request("GET", "/", headers=[("connection", "close")])
        await client.aclose()
        await trio.testing.wait_all_tasks_blocked()
        client_closed.set()
        await trio.testing.wait_all_tasks_blocked()
    assert response.body == b"done"
    assert after_response == [False]


async def test_pipelined_requests_are_all_answered_in_order(serve_client: ServeClient) -> None:
    handler = Recorder()
    raw = b"GET /1 HTTP/1.1\r\nHost: t\r\n\r\nGET /2 HTTP/1.1\r\nHost: t\r\n\r\n"
    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_raw(raw)
        first = await client.read_response()
        second = await client.read_response()
    assert (first.status, second.status) == (200, 200)
    assert [r.path for r in handler.requests] == ["/1", "/2"]


async def test_request_arriving_while_handler_runs_is_kept_for_the_next_cycle(
    serve_client: ServeClient,
) -> None:
    slow_started = trio.Event()
    proceed = trio.Event()
    seen: list[Request] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        seen.append(request)
        if request.path == "/slow":
            slow_started.set()
            await proceed.wait()
        await writer.respond(200, [], request.path.encode())

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_raw(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        await slow_started.wait()
        await client.send_raw(b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
        # The disconnect watcher has read the second request by now.
        await trio.testing.wait_all_tasks_blocked()
        proceed.set()
        first = await client.read_response()
        second = await client.read_response()
    assert (first.body, second.body) == (b"/slow", b"/next")
    assert [r.path for r in seen] == ["/slow", "/next"]
    assert seen[0].client_gone is False


async def test_failed_send_while_streaming_raises_client_disconnected(
    caplog: pytest.LogCaptureFixture, serve_client: ServeClient
) -> None:
    started = trio.Event()
    reset = trio.Event()
    done = trio.Event()
    outcome: list[bool] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200, [])
        await writer.write(b"first")
        started.set()
        await reset.wait()
        try:
            for _ in range(100):  # the kernel may take a write or two after the reset
                await writer.write(b"x" * 65536)
        except ClientDisconnected:
            outcome.append(request.client_gone)
            raise
        finally:
            done.set()

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_raw(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        await started.wait()
        # Pipelined bytes end the watch, so only the failed send can tell.
        await client.send_raw(b"GET /next HTTP/1.1\r\n")
        await trio.testing.wait_all_tasks_blocked()
        linger_off = struct.pack("ii", 1, 0)
        client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_off)
        await client.aclose()
        reset.set()
        await done.wait()
    assert outcome == [True]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /next HTTP/1.1\r\nHo"],
    ids=["idle between requests", "halfway through a head"],
)
async def test_a_reset_while_the_server_waits_for_a_head_ends_the_connection_quietly(
    caplog: pytest.LogCaptureFixture, serve_client: ServeClient, sent: bytes
) -> None:
    """The reset reaches the reader while the connection's task waits for bytes: the wait
    ends in the reset, not in an error of the server's own (a traceback per reset)."""
    recorder = Recorder()
    with trio.fail_after(GUARD_S):
        client = await serve_client(recorder)
        answer = await client.request("POST", "/first", body=b"one")
        if sent:
            await client.send_raw(sent)
        await trio.testing.wait_all_tasks_blocked()
        linger_off = struct.pack("ii", 1, 0)
        client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_off)
        await client.aclose()
        # Idle comes only after an I/O check that found nothing: the reset was read.
        await trio.testing.wait_all_tasks_blocked()
    assert answer.status == 200
    assert [r.path for r in recorder.requests] == ["/first"]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_refusal_right_after_a_handler_that_never_yielded_lingers_without_a_clash(
    caplog: pytest.LogCaptureFixture, serve: Serve, connect: Connect
) -> None:
    """The reader, parked with a pipelined request, is woken by that request's handler, which
    answers without yielding; the bytes after it are refused at once. The refusal's linger
    must not read the socket until the woken reader has stopped: trio allows one reader of a
    socket, and a second raised BusyResourceError (a traceback per such connection). Which
    of the two reads first is trio's coin toss within a batch, so the race is run often
    enough that one side's win cannot hide it (each run loses it at one chance in two)."""
    release = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/first":
            await release.wait()
        await writer.respond(200, [], request.path.encode())  # no wait: the socket has room

    with trio.fail_after(GUARD_S):
        port = await serve(handler)
        for _ in range(RACE_RUNS):
            release = trio.Event()
            client = await connect(port)
            await client.send_raw(b"GET /first HTTP/1.1\r\nHost: t\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()
            # Read by the reader while /first's handler runs, so the reader parks.
            await client.send_raw(b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n\x00 no\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            first = await client.read_response()
            second = await client.read_response()
            refused = await client.read_response()
            assert (first.body, second.body, refused.status) == (b"/first", b"/second", 400)
            await client.aclose()
            await trio.testing.wait_all_tasks_blocked()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_shutdown_lets_a_stream_finish_then_returns(connect: Connect) -> None:
    release = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/plain":
            await writer.respond(200, [], b"plain")
            return
        await writer.start(200, [])
        await writer.write(b"one")
        await release.wait()
        await writer.write(b"two")
        await writer.finish()

    run = ServerRun()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(run, handler, ServerSettings())
            idle = await connect(port)
            idle_answer = await idle.request("GET", "/plain")
            client = await connect(port)
            await client.send_request("GET", "/stream")
            head = await client.read_head()
            first = await client.read_chunk()
            run.shutdown.set()
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(OSError):
                await trio.open_tcp_stream("127.0.0.1", port)
            idle_rest = await idle.read_until_eof()
            returned_early = run.returned.is_set()
            release.set()
            second = await client.read_chunk()
            end = await client.read_chunk()
            rest = await client.read_until_eof()
            await run.returned.wait()
    assert idle_answer.status == 200
    assert idle_rest == b""
    assert returned_early is False
    assert head.status == 200
    assert (first, second, end, rest) == (b"one", b"two", None, b"")


async def test_response_finishing_during_shutdown_says_connection_close(connect: Connect) -> None:
    started = trio.Event()
    release = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        started.set()
        await release.wait()
        await writer.respond(200, [], b"late")

    run = ServerRun()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(run, handler, ServerSettings())
            client = await connect(port)
            await client.send_request("GET", "/")
            await started.wait()
            run.shutdown.set()
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            response = await client.read_response()
            rest = await client.read_until_eof()
            await run.returned.wait()
    assert (response.status, response.body) == (200, b"late")
    assert response.header(b"connection") == b"close"
    assert rest == b""


async def test_shutdown_grace_expiry_cancels_a_stuck_handler(connect: Connect) -> None:
    started = trio.Event()
    cancelled: list[float] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append(trio.current_time())

    run = ServerRun()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(run, handler, ServerSettings(shutdown_grace_s=0.2))
            client = await connect(port)
            await client.send_request("GET", "/")
            await started.wait()
            begin = trio.current_time()
            run.shutdown.set()
            await run.returned.wait()
            rest = await client.read_until_eof()
    assert len(cancelled) == 1
    assert cancelled[0] - begin >= 0.2
    assert rest == b""


async def test_connections_over_the_cap_get_503_until_a_slot_frees(
    connect: Connect, serve: Serve
) -> None:
    handler = Recorder()
    settings = ServerSettings(max_connections=1)
    with trio.fail_after(GUARD_S):
        port = await serve(handler, settings)
        holder = await connect(port)
        held = await holder.request("GET", "/held")
        extra = await connect(port)
        await extra.send_request("GET", "/extra")
        busy = await extra.read_response()
        extra_rest = await extra.read_until_eof()
        await holder.aclose()
        await trio.testing.wait_all_tasks_blocked()
        later = await connect(port)
        served = await later.request("GET", "/later")
    assert held.status == 200
    assert busy.status == 503
    assert busy.header(b"retry-after") == b"1"
    assert busy.json()["error"]["code"] == "server_busy"
    assert extra_rest == b""
    assert served.status == 200
    assert [r.path for r in handler.requests] == ["/held", "/later"]


async def test_handler_failure_before_start_is_500_and_connection_keeps_serving(
    caplog: pytest.LogCaptureFixture, serve_client: ServeClient
) -> None:
    async def handler(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/boom":
            raise ValueError("handler bug")
        if request.path == "/silent":
            return
        await writer.respond(200, [], b"ok")

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        boom = await client.request("GET", "/boom")
        silent = await client.request("GET", "/silent")
        ok = await client.request("GET", "/ok")
    assert (boom.status, silent.status, ok.status) == (500, 500, 200)
    assert boom.json()["error"]["type"] == "internal_error"
    assert "handler bug" not in boom.body.decode()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is ValueError


@pytest.mark.parametrize("raises", [True, False], ids=["raises", "returns-unfinished"])
async def test_handler_leaving_a_started_response_closes_the_connection(
    raises: bool, serve_client: ServeClient
) -> None:
    async def handler(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200, [])
        await writer.write(b"partial")
        if raises:
            raise ValueError("mid-stream bug")

    with trio.fail_after(GUARD_S):
        client = await serve_client(handler)
        await client.send_request("GET", "/")
        head = await client.read_head()
        chunk = await client.read_chunk()
        rest = await client.read_until_eof()
    assert head.status == 200
    assert chunk == b"partial"
    # Only the CRLF closing the "partial" chunk, never the zero-length last chunk: the
    # client can tell the body is incomplete.
    assert rest in (b"", b"\r\n")


async def test_bind_failure_raises_oserror_from_start(connect: Connect, serve: Serve) -> None:
    handler = Recorder()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await serve(handler)
            with pytest.raises(OSError):
                await nursery.start(partial(serve_http, handler, ServerSettings(port=port)))
            client = await connect(port)
            response = await client.request("GET", "/")
            nursery.cancel_scope.cancel()
    assert response.status == 200

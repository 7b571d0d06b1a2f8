"""The connection's one reader task: it reads on after bytes the connection asked for (its
next read is the handler's disconnect watch, with no wake-up to arm it), and an
end-of-stream it saw before the handler started still counts as the client gone."""

from __future__ import annotations

import socket

import trio
import trio.testing

from router.http.server.exceptions import plain_refusal
from router.http.server.load import ServerLoad
from router.http.server.loop import _Connection, _Server
from router.http.server.messages import Request, ResponseWriter
from router.http.server.settings import ServerSettings

GUARD_S = 5.0


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, theirs


def connection(handler: object) -> tuple[_Connection, socket.socket]:
    ours, theirs = tcp_pair()
    settings = ServerSettings()
    load = ServerLoad(settings.max_buffered_body_bytes)
    server = _Server(handler, settings, load, plain_refusal)  # type: ignore[arg-type]
    return _Connection(server, ours), theirs


async def test_an_end_of_stream_read_before_the_handler_started_cancels_it() -> None:
    finished: list[bool] = []

    async def handler(request: Request, writer: ResponseWriter) -> None:
        await trio.sleep_forever()
        finished.append(True)

    conn, peer = connection(handler)
    request = Request(method="POST", target="/", headers=[(b"host", b"t")])
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.reader.run)
            peer.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            await conn.reader.receive()  # the connection's task asks for, and gets, a request
            # The client leaves before the handler starts: the reader, reading on, sees it.
            peer.close()
            await trio.testing.wait_all_tasks_blocked()
            assert conn.reader.ended
            with conn.gone_scope:
                await conn._run_handler(request)
    assert request.client_gone is True
    assert conn.gone_scope.cancelled_caught
    assert finished == []
    conn.socket.close()


async def test_while_a_handler_runs_the_reader_is_reading_and_sees_the_client_leave() -> None:
    started = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        started.set()
        await trio.sleep_forever()

    conn, peer = connection(handler)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.serve)
            peer.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}")
            await started.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not conn.reader._parked  # reading: the disconnect watch
            peer.close()
            await trio.testing.wait_all_tasks_blocked()
            assert conn.gone_scope.cancel_called
    conn.socket.close()

"""`python -m bench.trio_floor`: the least any trio relay pays, as a bench contender.

Bytes only: each client connection gets one upstream connection of its own (to the next
worker, round robin), every request goes to it verbatim and the answer comes back
verbatim, each read from the worker sent on at once. No parse beyond finding where a
request and an answer end, no routing, no pool, no metrics, no limits: what is left is
trio's wake-up per read, the system calls and the Python that joins them. Measured beside
`ours` and `smg` (`--contenders ours,trio-floor,smg`), it says how much of a router's CPU
per request or per event trio costs before the router does anything, and so how much a
router on trio can cut at all (docs/performance.md, "The trio floor").

It serves the bench's fake fleet and nothing else: requests framed by a content-length,
answers by a content-length or chunked, a chunked answer's end taken from its last bytes
(`0\\r\\n\\r\\n`), which no SSE event ends with.
"""

from __future__ import annotations

import argparse
import itertools
import socket
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import trio

RECEIVE_SIZE = 65536
CHUNKED_END = b"0\r\n\r\n"


async def receive(sock: socket.socket) -> bytes:
    while True:
        try:
            return sock.recv(RECEIVE_SIZE)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def send_all(sock: socket.socket, data: bytes) -> None:
    with memoryview(data) as view:
        sent = 0
        while sent < len(data):
            try:
                sent += sock.send(view[sent:])
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)


def content_length(head: bytes) -> int | None:
    """The head's content-length, None when it has none."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


class Relay:
    """One client connection and its own upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.pending = b""  # client bytes received beyond the request relayed

    async def request(self) -> bool:
        """Relays the client's next request whole; False when the client is gone."""
        data = self.pending
        while b"\r\n\r\n" not in data:
            more = await receive(self.client)
            if not more:
                return False
            data += more
        head_end = data.index(b"\r\n\r\n") + 4
        end = head_end + (content_length(data[:head_end]) or 0)
        while len(data) < end:
            more = await receive(self.client)
            if not more:
                return False
            data += more
        self.pending = data[end:]
        await send_all(self.upstream, data[:end])
        return True

    async def answer(self) -> bool:
        """Relays the worker's answer, each read as it comes; False when the worker closed."""
        head = b""
        while b"\r\n\r\n" not in head:
            data = await receive(self.upstream)
            if not data:
                return False
            await send_all(self.client, data)
            head += data
        head_end = head.index(b"\r\n\r\n") + 4
        length = content_length(head[:head_end])
        if length is not None:
            left = length - (len(head) - head_end)
            while left > 0:
                data = await receive(self.upstream)
                if not data:
                    return False
                await send_all(self.client, data)
                left -= len(data)
            return True
        tail = head[-len(CHUNKED_END) :]
        while not tail.endswith(CHUNKED_END):
            data = await receive(self.upstream)
            if not data:
                return False
            await send_all(self.client, data)
            tail = (tail + data)[-len(CHUNKED_END) :]
        return True


async def connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.connect(address)
    except BlockingIOError:
        await trio.lowlevel.wait_writable(sock)
    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        sock.close()
        raise OSError(error, f"cannot connect to {address}")
    return sock


async def serve_connection(stream: trio.SocketStream, workers: Iterator[tuple[str, int]]) -> None:
    held = stream.socket
    client = socket.socket(held.family, held.type, held.proto, fileno=held.detach())
    client.setblocking(False)
    try:
        upstream = await connect(next(workers))
    except OSError:
        client.close()
        return
    relay = Relay(client, upstream)
    try:
        while await relay.request() and await relay.answer():
            pass
    except OSError:
        pass  # a peer left mid-exchange: the connection ends
    finally:
        upstream.close()
        client.close()


def worker_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"a worker is http://host:port, not {url!r}")
    return parts.hostname, parts.port


async def serve(port: int, urls: Sequence[str]) -> None:
    workers = itertools.cycle([worker_address(url) for url in urls])
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    print(f"trio-floor listening on http://127.0.0.1:{port}", flush=True)

    async def handle(stream: trio.SocketStream) -> None:
        await serve_connection(stream, workers)

    await trio.serve_listeners(handle, listeners)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.trio_floor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", action="append", required=True, help="http://host:port")
    args = parser.parse_args(argv)
    trio.run(serve, args.port, args.worker)


if __name__ == "__main__":
    main()

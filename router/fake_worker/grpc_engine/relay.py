"""The fake gRPC engine's listening socket, relaying every client connection to grpcio.

grpcio's server owns its sockets and offers no public way to cut one, yet the fake's
scripted `reset` must do to a client what a crashed engine's kernel does: a TCP reset,
before the first message or in the middle of a stream. So the fake's port is this relay:
each client connection is piped, bytes as they come, to grpcio's server on a private
loopback port, and `cut` resets the client connection that carries a given call (grpcio
names a call's peer, which is the relay's own connection to it, so the relay knows which
client that is). A cut ends every call on that connection, as a real reset does.

asyncio, like the grpcio server it serves (`router.fake_worker.grpc_engine.main` says why).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field

CHUNK = 64 * 1024
# A cut waits for grpcio's writes to reach the client: quiet this long, at most the bound.
SETTLE_S = 0.02
SETTLE_BOUND_S = 1.0


@dataclass(slots=True)
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    cut: bool = False
    to_client: int = 0  # bytes relayed from grpcio to the client


@dataclass(slots=True)
class ConnectionRelay:
    """Accepts clients on `host:port` and pipes each to `127.0.0.1:upstream_port`.

    `start` binds (OSError if it cannot) and returns the bound port; `close` stops
    accepting and drops every connection; `cut(peer)` resets one client connection.
    """

    upstream_port: int
    # The relay's connections to grpcio, by their local port: what grpcio calls the peer.
    _pairs: dict[int, _Pair] = field(default_factory=dict)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    connections: int = 0
    cuts: int = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting, reset what is still connected, and wait for the pipes to end."""
        if self._server is not None:
            self._server.close()
        for pair in list(self._pairs.values()):
            _reset(pair.client)
            pair.upstream.transport.abort()
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    async def cut(self, peer: str) -> bool:
        """Reset the client connection that carries grpcio's call from `peer` (grpcio's
        form: `ipv4:127.0.0.1:54321`), once what grpcio wrote before has gone through;
        False when no such connection is open.

        "Gone through": nothing more came from grpcio for `SETTLE_S`, waited at most
        `SETTLE_BOUND_S` (a stream that never pauses is cut then). Cancellation: nothing
        is cut.
        """
        try:
            local_port = int(peer.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return False
        pair = self._pairs.get(local_port)
        if pair is None or pair.cut:
            return False
        pair.cut = True
        deadline = asyncio.get_running_loop().time() + SETTLE_BOUND_S
        while asyncio.get_running_loop().time() < deadline:
            seen = pair.to_client
            await asyncio.sleep(SETTLE_S)
            if pair.to_client == seen:
                break
        self.cuts += 1
        _reset(pair.client)
        pair.upstream.transport.abort()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    "127.0.0.1", self.upstream_port
                )
            except OSError:
                _reset(writer)
                return
            local_port = int(up_writer.get_extra_info("sockname")[1])
            pair = self._pairs[local_port] = _Pair(writer, up_writer)
            try:
                async with asyncio.TaskGroup() as pipes:
                    pipes.create_task(_pipe(reader, up_writer))
                    pipes.create_task(_pipe(up_reader, writer, pair))
            finally:
                del self._pairs[local_port]
                up_writer.transport.abort()
                writer.transport.abort()
        finally:
            self._tasks.discard(task)


async def _pipe(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, counted: _Pair | None = None
) -> None:
    """Copy until either side ends, counting into `counted`; then close `sink`."""
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
            if counted is not None:
                counted.to_client += len(data)
    except (ConnectionError, OSError):
        pass
    finally:
        sink.transport.abort()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0, so the kernel answers with a TCP reset, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()

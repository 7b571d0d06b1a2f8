"""Listening TCP sockets, optionally shared between processes with SO_REUSEPORT.

`trio.open_tcp_listeners` sets its socket options itself, and SO_REUSEPORT must be set
before `bind`, so sharing a port needs sockets of our own making. Both fronts use them:
the native server takes them over (`router.http.server.batch_listener`), the hypercorn front hands their file
descriptors to hypercorn.
"""

from __future__ import annotations

import errno
from typing import Final

import trio

# Linux stores the backlog in 16 bits and clamps it to net.core.somaxconn anyway.
_BACKLOG: Final = 0xFFFF


async def open_tcp_sockets(
    host: str, port: int, *, reuse_port: bool = False
) -> list[trio.socket.SocketType]:
    """Bound, listening sockets, one per address `host` resolves to.

    `reuse_port`: SO_REUSEPORT goes on before `bind`, so every process that does the same
    for the same address and port shares it, and the kernel spreads new connections among
    them. Raises OSError when an address cannot be bound (none of the sockets is left open).
    Cancellation: the sockets made so far are closed.
    """
    addresses = await trio.socket.getaddrinfo(
        host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE
    )
    sockets: list[trio.socket.SocketType] = []
    try:
        for family, type_, proto, _, sockaddr in addresses:
            try:
                sock = trio.socket.socket(family, type_, proto)
            except OSError as exc:
                if exc.errno == errno.EAFNOSUPPORT and len(addresses) > 1:
                    continue
                raise
            sockets.append(sock)
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
            if family == trio.socket.AF_INET6:
                sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
            await sock.bind(sockaddr)
            sock.listen(_BACKLOG)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise OSError(errno.EAFNOSUPPORT, f"no usable address family for {host!r}")
    return sockets

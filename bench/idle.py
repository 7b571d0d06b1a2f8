"""Hold many idle SSE streams open through a router, on raw trio sockets.

Each stream is one connection with one streaming request, read until its first event, so
the stream is known to reach a worker; then all of them stay open, silent, while the
caller measures the router, and close together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

_OPENING_AT_ONCE = 256
_RECEIVE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class IdleResult:
    opened: int
    failed: int
    measured: dict[str, float]
    open_s: float


def hold_idle_streams(
    port: int, body: bytes, count: int, measure: Callable[[], dict[str, float]], timeout_s: float
) -> IdleResult:
    """Open `count` streams to 127.0.0.1:`port`, call `measure()` while all are open, close.

    Streams that fail to open (or to show a first event) are counted, not retried. The whole
    run stops after `timeout_s`; what was measured by then is returned.
    """
    return trio.run(_hold, port, body, count, measure, timeout_s)


async def _hold(
    port: int, body: bytes, count: int, measure: Callable[[], dict[str, float]], timeout_s: float
) -> IdleResult:
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    ) + body
    streams: list[trio.SocketStream] = []
    failed = 0
    measured: dict[str, float] = {}
    started = trio.current_time()
    open_s = 0.0
    limiter = trio.CapacityLimiter(_OPENING_AT_ONCE)

    async def open_one() -> None:
        nonlocal failed
        async with limiter:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                failed += 1
                return
            try:
                await stream.send_all(request)
                seen = b""
                while b"data: " not in seen:
                    data = await stream.receive_some(_RECEIVE_BYTES)
                    if not data:
                        raise trio.BrokenResourceError("closed before the first event")
                    seen += data
                    if b"\r\n" in seen and not seen.startswith(b"HTTP/1.1 200 "):
                        # Turned away (a 503 says why): no stream to hold.
                        raise trio.BrokenResourceError(seen.split(b"\r\n", 1)[0].decode())
            except (trio.BrokenResourceError, OSError):
                failed += 1
                await stream.aclose()
                return
            streams.append(stream)

    try:
        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(open_one)
            open_s = trio.current_time() - started
            measured = measure()
    finally:
        with trio.CancelScope(shield=True):
            for stream in streams:
                await stream.aclose()
    return IdleResult(opened=len(streams), failed=failed, measured=measured, open_s=open_s)

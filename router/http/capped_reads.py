"""Closing an httpx response stream that was left before its end, without leaks.

httpx reads through a stack of nested async generators; closing only the outer one leaves
the inner ones suspended for the garbage collector, which trio reports as a leak. Once
the response is closed the innermost read fails at once, and that error unwinds every
layer, so running the iterator to its end after `aclose()` is what cleans them up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import trio

DRAIN_BACKSTOP_S: Final = 1.0
"""Only a backstop: a closed stream ends at once; cancellation unwinds the layers too."""


async def close_stream(response: httpx.Response, iterator: AsyncIterator[Any]) -> None:
    """Close `response` and unwind `iterator` (one of its `aiter_*`), discarding the rest.

    Runs shielded, so it also completes on a cancelled path.
    """
    with trio.move_on_after(DRAIN_BACKSTOP_S, shield=True):
        await response.aclose()
        try:
            async for _ in iterator:
                pass
        except (httpx.HTTPError, httpx.StreamError):
            pass  # the expected end of a closed stream


class StreamTooLarge(Exception):
    """A response body went past the bound its reader set."""


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """The body of a streamed `response`, refused (StreamTooLarge) past `limit` bytes
    before more is held; the stream is closed either way."""
    body = bytearray()
    chunks = response.aiter_bytes()
    try:
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                raise StreamTooLarge(f"answer larger than {limit} bytes")
    finally:
        await close_stream(response, chunks)
    return bytes(body)

"""A request to a worker as bytes: one join of head and body, checked as it is built."""

from __future__ import annotations

import re
from typing import Final

from router.http.field_names import TOKEN, lowered_field_name

__all__ = ["encode_request"]

_TARGET: Final = re.compile(rb"[^\x00-\x20\x7f]+")
# One search, not `b"\r" in value` and the like: on bytes, `in` tries the operand as an
# int first and makes and drops a TypeError each time (docs/performance.md, "fifth round").
_UNSENDABLE: Final = re.compile(rb"[\r\n\x00]")


def encode_request(
    method: str, target: str, host: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """The request's bytes: head (with `host` and `content-length`) and body, in one join.

    Raises ValueError for a method, target or header that HTTP/1.1 cannot carry: our own
    request is malformed, a bug to see, not a worker fault to fail over from.
    """
    method_bytes = method.encode("ascii")
    target_bytes = target.encode("ascii")
    if TOKEN.fullmatch(method_bytes) is None or _TARGET.fullmatch(target_bytes) is None:
        raise ValueError(f"cannot send request line {method!r} {target!r}")
    parts = [
        method_bytes,
        b" ",
        target_bytes,
        b" HTTP/1.1\r\nhost: ",
        host,
        b"\r\ncontent-length: ",
        b"%d" % len(body),
        b"\r\n",
    ]
    for name, value in headers:
        if lowered_field_name(name) is None or _UNSENDABLE.search(value) is not None:
            raise ValueError(f"cannot send header {name!r}: {value!r}")
        parts += (name, b": ", value, b"\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)

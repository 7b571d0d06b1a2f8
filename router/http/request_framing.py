"""The checks of a request head that h11 0.16 does not make: request smuggling (RFC 9112
sections 6.1 and 6.3). Pure; the server calls `check_framing` as soon as a head is parsed,
and answers a failure 400 and closes the connection, so nothing pipelined behind it runs.

What h11 refuses by itself (found by feeding it each case): two different Content-Length
values (also `5, 6` in one field), a Transfer-Encoding other than a lone `chunked`
(`gzip, chunked`, `chunked, gzip`, `identity`, two fields; h11 hints 501, the server
answers 400 because the body's end cannot be found), a chunk size that is not 1 to 20 hex
digits, a NUL or CR in a header line, a continuation line before the first header.

What h11 lets through, and this module refuses:
- both Content-Length and Transfer-Encoding (h11 frames by Transfer-Encoding; a front
  proxy may frame by Content-Length, and the difference is a smuggled request);
- Transfer-Encoding on an HTTP/1.0 request (section 6.1: the framing is faulty);
- obs-fold, a header line starting with SP or HTAB (h11 joins it to the line before).
  h11 hands back only the joined value, so the raw head bytes are searched.
What h11 lets through in a chunked body is refused by `router.http.chunked_framing`.
"""

from __future__ import annotations

import re

import h11

from router.errors import BadRequest

__all__ = ["FramingError", "check_framing"]

# h11 ends a head at its first empty line, with or without the CR.
_HEAD_END = re.compile(rb"\n\r?\n")
_FOLD = re.compile(rb"\n[ \t]")


class FramingError(BadRequest):
    """A request whose framing cannot be trusted: answered 400, connection closed."""


def check_framing(head: h11.Request, raw: bytes | bytearray) -> tuple[int, bool]:
    """The length of `head` in `raw` (the bytes h11 parsed it from, and any after it), and
    whether its body is chunked; raises FramingError when another HTTP parser could frame
    it differently."""
    has_length = has_coding = False
    for name, _ in head.headers:
        if name == b"content-length":
            has_length = True
        elif name == b"transfer-encoding":
            has_coding = True
    if has_coding:
        if has_length:
            raise FramingError("a request may not carry both Content-Length and Transfer-Encoding")
        if head.http_version != b"1.1":
            raise FramingError("Transfer-Encoding is not allowed in an HTTP/1.0 request")
    end = _HEAD_END.search(raw)
    # h11 found the empty line that ends the head, so `end` is never None in practice.
    head_length = len(raw) if end is None else end.end()
    if _FOLD.search(raw, 0, head_length) is not None:
        raise FramingError("obsolete line folding (a header line starting with a space or tab)")
    return head_length, has_coding

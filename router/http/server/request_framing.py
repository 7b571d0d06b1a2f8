"""The checks of a request head's framing made on our side, whatever the parser: request
smuggling (RFC 9112 sections 6.1 and 6.3). Pure; the request parser calls `check_framing`
as soon as a head is parsed, and the server answers a failure 400 and closes the
connection, so nothing pipelined behind it runs.

Refused here (some also by llhttp, see `router.http.server.request_parser`):
- both Content-Length and Transfer-Encoding (one parser frames by one, another by the
  other, and the difference is a smuggled request);
- a Transfer-Encoding other than one lone `chunked` (`gzip, chunked`: the body's end
  cannot be found);
- Transfer-Encoding on an HTTP/1.0 request (section 6.1: the framing is faulty);
- obs-fold, a header line starting with SP or HTAB, searched in the raw head bytes.
What a chunked body may not hold is refused by `router.http.server.chunked_framing`.
"""

from __future__ import annotations

import re
from typing import Final

from router.http.server.exceptions import MalformedRequest

__all__ = ["FramingError", "check_framing"]

# A head ends at its first empty line (with or without the CR, for the check's sake).
_HEAD_END: Final = re.compile(rb"\n\r?\n")
_FOLD: Final = re.compile(rb"\n[ \t]")


class FramingError(MalformedRequest):
    """A request whose framing cannot be trusted: answered 400, connection closed."""


def check_framing(
    headers: list[tuple[bytes, bytes]], http_version: bytes, raw: bytes | bytearray
) -> tuple[int, bool]:
    """The length of the head in `raw` (the head's bytes, and any after it), and whether its
    body is chunked; raises FramingError when another HTTP parser could frame it
    differently."""
    has_length = False
    codings = 0
    lone_chunked = True
    for name, value in headers:
        if name == b"content-length":
            has_length = True
        elif name == b"transfer-encoding":
            codings += 1
            lone_chunked = lone_chunked and value.lower() == b"chunked"
    if codings:
        if has_length:
            raise FramingError("a request may not carry both Content-Length and Transfer-Encoding")
        if http_version != b"1.1":
            raise FramingError("Transfer-Encoding is not allowed in an HTTP/1.0 request")
        if codings > 1 or not lone_chunked:
            raise FramingError("a Transfer-Encoding other than one lone chunked")
    end = _HEAD_END.search(raw)
    head_length = len(raw) if end is None else end.end()
    if _FOLD.search(raw, 0, head_length) is not None:
        raise FramingError("obsolete line folding (a header line starting with a space or tab)")
    return head_length, codings > 0

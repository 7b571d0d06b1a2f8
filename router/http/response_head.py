"""A worker's response head parsed: status line and header lines, strictly.

Anything that is not an HTTP/1.x status line with a status from 100 to 599, or a header
line that is not `token: value`, raises `UpstreamProtocolError`: the worker answered, but
not in HTTP, and the attempt fails over.
"""

from __future__ import annotations

import re

from router.http.upstream_errors import UpstreamProtocolError

__all__ = ["HEADER_LINE", "header_tokens", "parse_response_head"]

# RFC 9112 section 4: HTAB, SP, visible ASCII and obs-text; a bare CR is not a character
# of a reason phrase but a way to hide a second status line from one parser of two.
_REASON = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
# A field value is visible characters, obs-text, spaces and tabs (RFC 9110 section 5.5):
# a control byte in a worker's header would reach the client, or split a line there.
HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([\t\x20-\x7e\x80-\xff]*?)[ \t]*")


def parse_response_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], bool]:
    """The status, the headers (names lower-case) and whether the version allows keep-alive."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    version = status_line[:9]
    if version == b"HTTP/1.1 ":
        keep_alive = True
    elif version == b"HTTP/1.0 ":
        keep_alive = False
    else:
        raise UpstreamProtocolError(
            f"upstream sent no HTTP/1.1 status line: {status_line[:40]!r}", response_started=True
        )
    code = status_line[9:12]
    if (
        not code.isdigit()
        or not b"100" <= code <= b"599"
        or (len(status_line) > 12 and status_line[12] != 32)
        or _REASON.fullmatch(status_line, 13) is None
    ):
        # A status outside 100-599 (`000` included) is no HTTP answer: RFC 9110 section 15.
        raise UpstreamProtocolError(
            f"upstream sent a malformed status line: {status_line[:40]!r}", response_started=True
        )
    headers = []
    for line in lines[1:]:
        match = HEADER_LINE.fullmatch(line)
        if match is None:
            raise UpstreamProtocolError(
                f"upstream sent a malformed header line: {line[:40]!r}", response_started=True
            )
        headers.append((match[1].lower(), match[2]))
    return int(code), headers, keep_alive


def header_tokens(value: bytes) -> list[bytes]:
    return [token.strip() for token in value.lower().split(b",")]

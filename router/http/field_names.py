"""Header field names, checked against HTTP's token grammar (RFC 9110 section 5.1) once per
distinct name rather than once per header sent: a router sends the same dozen names on
every request and answer.

The memory is bounded: at most `KNOWN_NAMES` names of at most `KNOWN_NAME_BYTES` bytes are
kept (a worker sending ever new names fills it once, then is checked every time), and a
name is kept only after it passed the check.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["KNOWN_NAMES", "TOKEN", "known_name_count", "lowered_field_name"]

TOKEN: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
"""HTTP's token (RFC 9110 section 5.6.2): a field name, a method."""
KNOWN_NAMES: Final = 512
KNOWN_NAME_BYTES: Final = 64
_known: Final[dict[bytes, bytes]] = {}


def lowered_field_name(name: bytes) -> bytes | None:
    """`name` in lower case when it is a token, None when it is not."""
    lowered = _known.get(name)
    if lowered is not None:
        return lowered
    if TOKEN.fullmatch(name) is None:
        return None
    lowered = name.lower()
    if len(_known) < KNOWN_NAMES and len(name) <= KNOWN_NAME_BYTES:
        _known[name] = lowered
    return lowered


def known_name_count() -> int:
    """How many names are remembered (for tests: the bound holds)."""
    return len(_known)

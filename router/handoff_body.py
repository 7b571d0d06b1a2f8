"""The PD body: the client's own bytes with the handoff fields spliced in.

The body is never re-serialised. Parsing and dumping again would change what the client
sent (an integer above 64 bits becomes a float, `1.0` becomes `1`) and can fail on input
that parsed (JSON nested deeper than the encoder allows). Instead the router's members are
inserted right after the opening `{` of the top-level object; every byte the client sent
follows unchanged.

A client body that already carries a handoff key (`bootstrap_host`, `bootstrap_port`,
`bootstrap_room`, `disagg_prefill_dp_rank`) has those members removed, however they are
spelled (a key may use escapes), and the router's take their place: the handoff is the
router's to make, and a body never carries a key twice. The other members keep their exact
bytes; only the whitespace between top-level members is not kept on that path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

HANDOFF_KEYS = frozenset({"bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"})

_WHITESPACE = b" \t\n\r"
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(rb"[^,}\]\s]+")
_STRUCTURAL = re.compile(rb'["\[\]{}]')
_OPEN = frozenset(b"[{")


class UnspliceableBody(ValueError):
    """The body is not a JSON object this module can splice into; the message says why."""


def splice_handoff(raw: bytes, body: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """`raw` (a JSON object, already parsed into `body`) with `fields` as its first members.

    `fields` are the router's own values (strings and integers below 2**63), which always
    serialise. Raises UnspliceableBody when `raw` is not shaped as its parse says.
    """
    members = orjson.dumps(dict(fields))[1:-1]
    if not members:
        return raw
    if HANDOFF_KEYS.isdisjoint(body):
        try:
            start = _object_start(raw)
        except IndexError:
            raise UnspliceableBody("the body is not a JSON object") from None
        separator = b"," if body else b""
        return raw[: start + 1] + members + separator + raw[start + 1 :]
    kept = [raw[begin:end] for begin, end, key in top_level_members(raw) if key not in HANDOFF_KEYS]
    return b"{" + b",".join([members, *kept]) + b"}"


def top_level_members(raw: bytes) -> list[tuple[int, int, str]]:
    """`(start, end, key)` of each top-level member of the JSON object `raw`: the bytes
    `raw[start:end]` are the member as sent, key through value. `raw` must be valid JSON
    (it was parsed before); anything else raises UnspliceableBody."""
    try:
        return _members(raw)
    except (IndexError, orjson.JSONDecodeError) as exc:
        raise UnspliceableBody(f"the body's top-level object cannot be scanned: {exc}") from None


def _members(raw: bytes) -> list[tuple[int, int, str]]:
    position = _skip_whitespace(raw, _object_start(raw) + 1)
    spans: list[tuple[int, int, str]] = []
    if raw[position] == ord("}"):
        return spans
    while True:
        key_match = _STRING.match(raw, position)
        if key_match is None:
            raise UnspliceableBody(f"expected a key at byte {position}")
        key = orjson.loads(key_match.group())
        position = _skip_whitespace(raw, key_match.end())
        if raw[position] != ord(":"):
            raise UnspliceableBody(f"expected ':' at byte {position}")
        end = _value_end(raw, _skip_whitespace(raw, position + 1))
        spans.append((key_match.start(), end, key))
        position = _skip_whitespace(raw, end)
        if raw[position] == ord("}"):
            return spans
        if raw[position] != ord(","):
            raise UnspliceableBody(f"expected ',' or '}}' at byte {position}")
        position = _skip_whitespace(raw, position + 1)


def _object_start(raw: bytes) -> int:
    start = _skip_whitespace(raw, 0)
    if start >= len(raw) or raw[start] != ord("{"):
        raise UnspliceableBody("the body is not a JSON object")
    return start


def _skip_whitespace(raw: bytes, position: int) -> int:
    while raw[position] in _WHITESPACE:
        position += 1
    return position


def _value_end(raw: bytes, position: int) -> int:
    """Where the JSON value starting at `position` ends (exclusive)."""
    first = raw[position]
    if first == ord('"'):
        match = _STRING.match(raw, position)
        if match is None:
            raise UnspliceableBody(f"unterminated string at byte {position}")
        return match.end()
    if first in _OPEN:
        depth = 0
        while True:
            found = _STRUCTURAL.search(raw, position)
            if found is None:
                raise UnspliceableBody("unbalanced brackets")
            char = raw[found.start()]
            if char == ord('"'):
                string = _STRING.match(raw, found.start())
                if string is None:
                    raise UnspliceableBody(f"unterminated string at byte {found.start()}")
                position = string.end()
                continue
            depth += 1 if char in _OPEN else -1
            position = found.end()
            if depth == 0:
                return position
    scalar = _SCALAR.match(raw, position)
    if scalar is None:
        raise UnspliceableBody(f"expected a value at byte {position}")
    return scalar.end()

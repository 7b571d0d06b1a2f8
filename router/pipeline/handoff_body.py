"""The body a worker gets: the client's own bytes with the router's members spliced in.

The router adds members of its own to a request body: the PD handoff (`bootstrap_host`,
`bootstrap_port`, `bootstrap_room`, `disagg_prefill_dp_rank`), the served model of an
alias or a fallback (`model`), the engine priority (`priority`). The body is never
re-serialised. Parsing and dumping again would change what the client sent (an integer
above 64 bits becomes a float, `1.0` becomes `1`) and can fail on input that parsed (JSON
nested deeper than the encoder allows). Instead the router's members are inserted right
after the opening `{` of the top-level object; every byte the client sent follows
unchanged.

A client body that already carries one of the router's keys has that member removed,
however it is spelled (a key may use escapes), and the router's takes its place: the
handoff, the model and the priority are the router's to set, and a body never carries a
key twice. The other members keep their exact bytes; only the whitespace between
top-level members is not kept on that path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import orjson

HANDOFF_KEYS: Final = frozenset(
    {"bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"}
)

_WHITESPACE: Final = " \t\n\r"
# The standard library's C scanner finds where each value ends (`raw_decode`) in one pass
# at C speed; a byte-by-byte scan in Python costs seconds on a hostile 30 MB body.
_DECODER: Final = json.JSONDecoder()


class UnspliceableBody(ValueError):
    """The body is not a JSON object this module can splice into; the message says why."""


def splice_handoff(raw: bytes, body: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """`raw` (a JSON object, already parsed into `body`) with `fields` as its first members,
    and any handoff member the client sent removed (see `splice_members`)."""
    return splice_members(raw, body, fields, HANDOFF_KEYS)


def splice_members(
    raw: bytes,
    body: Mapping[str, Any],
    fields: Mapping[str, Any],
    replaced: frozenset[str] | None = None,
) -> bytes:
    """`raw` (a JSON object, already parsed into `body`) with `fields` as its first members,
    and every member whose key is in `replaced` (default: the keys of `fields`) removed.

    `fields` are the router's own values (strings and integers below 2**63), which always
    serialise. Raises UnspliceableBody when `raw` is not shaped as its parse says.
    Cost: a byte copy of `raw`; when the client sent a replaced key, one scan of the body
    at C speed (about what parsing it cost).
    """
    members = orjson.dumps(dict(fields))[1:-1]
    if not members:
        return raw
    replaced = frozenset(fields) if replaced is None else replaced
    if replaced.isdisjoint(body):
        start = len(raw) - len(raw.lstrip())
        if raw[start : start + 1] != b"{":
            raise UnspliceableBody("the body is not a JSON object")
        separator = b"," if body else b""
        return raw[: start + 1] + members + separator + raw[start + 1 :]
    text = raw.decode("utf-8")  # parsed already, so valid; slices encode back to the same bytes
    kept = [
        text[begin:end].encode()
        for begin, end, key in top_level_members(text)
        if key not in replaced
    ]
    return b"{" + b",".join([members, *kept]) + b"}"


def top_level_members(text: str) -> list[tuple[int, int, str]]:
    """`(start, end, key)` of each top-level member of the JSON object `text`: the text
    `text[start:end]` is the member as sent, key through value. Anything that is not a JSON
    object (or nests deeper than the standard library's scanner goes) raises
    UnspliceableBody."""
    try:
        return _members(text)
    except (IndexError, ValueError, RecursionError) as exc:
        raise UnspliceableBody(f"the body's top-level object cannot be scanned: {exc}") from None


def _members(text: str) -> list[tuple[int, int, str]]:
    position = _skip_whitespace(text, 0)
    if text[position] != "{":
        raise UnspliceableBody("the body is not a JSON object")
    position = _skip_whitespace(text, position + 1)
    spans: list[tuple[int, int, str]] = []
    if text[position] == "}":
        return spans
    while True:
        if text[position] != '"':
            raise UnspliceableBody(f"expected a key at character {position}")
        key, after_key = json.decoder.scanstring(text, position + 1)  # type: ignore[attr-defined]
        colon = _skip_whitespace(text, after_key)
        if text[colon] != ":":
            raise UnspliceableBody(f"expected ':' at character {colon}")
        _, end = _DECODER.raw_decode(text, _skip_whitespace(text, colon + 1))
        spans.append((position, end, key))
        position = _skip_whitespace(text, end)
        if text[position] == "}":
            return spans
        if text[position] != ",":
            raise UnspliceableBody(f"expected ',' or '}}' at character {position}")
        position = _skip_whitespace(text, position + 1)


def _skip_whitespace(text: str, position: int) -> int:
    while text[position] in _WHITESPACE:
        position += 1
    return position

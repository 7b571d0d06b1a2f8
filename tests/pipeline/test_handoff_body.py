"""The PD body is the client's bytes plus exactly the handoff fields, never re-serialised."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.pipeline.handoff_body import (
    HANDOFF_KEYS,
    UnspliceableBody,
    splice_handoff,
    top_level_members,
)

FIELDS = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}


def exact(raw: bytes | str) -> Any:
    """Parse keeping every number's spelling: `1.0`, `1` and `-0.0` stay distinct, and an
    integer of any size stays exact. Duplicate keys are kept in order, so a key sent twice
    shows."""
    return json.loads(
        raw,
        parse_float=lambda text: ("float", text),
        parse_int=lambda text: ("int", text),
        object_pairs_hook=list,
    )


def splice(raw: bytes) -> bytes:
    return splice_handoff(raw, orjson.loads(raw), FIELDS)


def router_members() -> list[tuple[str, Any]]:
    return exact(orjson.dumps(FIELDS))  # type: ignore[no-any-return]


def test_numbers_reach_the_legs_as_the_client_spelled_them() -> None:
    raw = b'{"model":"m","seed":123456789012345678901234567890,"a":1.0,"b":1,"c":-0.0,"d":1E+300}'
    spliced = splice(raw)
    assert spliced == b"{" + orjson.dumps(FIELDS)[1:-1] + b"," + raw[1:]
    assert exact(spliced) == router_members() + exact(raw)


def test_escapes_whitespace_and_key_order_are_kept_byte_for_byte() -> None:
    raw = b'  {\n "z": "caf\\u00e9 \\ud83d\\ude00",\t"a" : [ 1 , {"k": "v"} ] }  '
    spliced = splice(raw)
    assert spliced.endswith(raw[3:])
    assert b"\\u00e9" in spliced and b"\\ud83d\\ude00" in spliced
    assert exact(spliced) == router_members() + exact(raw)


def test_an_empty_object_gets_no_dangling_comma() -> None:
    assert exact(splice(b"{}")) == router_members()
    assert exact(splice(b" { } ")) == router_members()


def test_a_body_deeper_than_the_encoder_allows_is_spliced() -> None:
    raw = b'{"model":"m","deep":' + b"[" * 300 + b"]" * 300 + b"}"
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(orjson.loads(raw))
    assert exact(splice(raw)) == router_members() + exact(raw)


def test_the_clients_handoff_keys_are_replaced_never_duplicated() -> None:
    raw = (
        b'{"model":"m","bootstrap_room":5,"x":{"bootstrap_room":7},'
        b'"bootstrap\\u005fhost":"evil","disagg_prefill_dp_rank":3,"y":[1,2],"bootstrap_room":6}'
    )
    spliced = splice(raw)
    members = exact(spliced)
    keys = [key for key, _ in members]
    assert keys == ["bootstrap_host", "bootstrap_port", "bootstrap_room", "model", "x", "y"]
    assert members[:3] == router_members()
    # A nested object's key of the same name is the client's business and stays.
    assert dict(members)["x"] == [("bootstrap_room", ("int", "7"))]


def test_a_client_handoff_key_in_a_hostile_body_costs_one_scan_not_a_python_loop() -> None:
    """Seven million short strings: a scan that steps through them in Python takes tens of
    seconds; the C scanner's pass is what parsing the body costs. Only the result is
    asserted here (timing is the benchmark's business), on a smaller body."""
    raw = b'{"bootstrap_room":1,"x":[' + b",".join([b'"a"'] * 100_000) + b"]}"
    spliced = splice(raw)
    assert spliced == b"{" + orjson.dumps(FIELDS)[1:-1] + b"," + raw[raw.index(b'"x"') :]


@pytest.mark.parametrize("raw", [b"[1]", b"   ", b""])
def test_a_body_that_is_not_an_object_cannot_be_spliced(raw: bytes) -> None:
    with pytest.raises(UnspliceableBody):
        splice_handoff(raw, {"model": "m"}, FIELDS)
    with pytest.raises(UnspliceableBody):
        top_level_members(raw.decode())


# JSON values with the awkward parts: huge and negative integers, floats, -0.0, any unicode.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
keys = st.one_of(st.text(max_size=10), st.sampled_from(sorted(HANDOFF_KEYS)))
objects = st.dictionaries(keys, values, max_size=6)


@settings(max_examples=150, deadline=None)
@given(obj=objects, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 0, 2]))
def test_the_spliced_body_is_the_clients_object_plus_exactly_the_handoff_fields(
    obj: dict[str, Any], ensure_ascii: bool, indent: int | None
) -> None:
    raw = json.dumps(obj, ensure_ascii=ensure_ascii, indent=indent).encode()
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return  # e.g. a lone surrogate: the router answers 400 before splicing
    spliced = splice_handoff(raw, parsed, FIELDS)
    client_members = [(key, value) for key, value in exact(raw) if key not in HANDOFF_KEYS]
    assert exact(spliced) == router_members() + client_members

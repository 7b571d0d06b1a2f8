"""Decoding of every encoding vLLM has shipped, and of what no engine should send."""

from __future__ import annotations

import msgspec
import pytest

from router.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    decode_message,
)
from tests.engines.kv_events.wire import Form, cleared, encode, removed, stored


@pytest.mark.parametrize("form", list(Form))
def test_every_encoding_decodes_to_the_same_events(form: Form) -> None:
    payload = encode(
        [
            stored([11, 12], None, [1, 2, 3, 4], 2, lora_name="ad", extra_keys=[("m", 1), None]),
            removed([11]),
            cleared(),
        ],
        form,
        dp_rank=3,
    )
    batch = decode_batch(payload)
    assert batch.dp_rank == 3
    assert batch.unknown_events == 0
    assert batch.events == [
        BlockStored(
            block_hashes=[11, 12],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_name="ad",
            extra_keys=[("m", 1), None],
            medium="GPU",
        ),
        BlockRemoved(block_hashes=[11], medium="GPU"),
        AllBlocksCleared(),
    ]


def test_array_events_are_tag_first_as_vllm_encodes_them() -> None:
    # The fixture's premise, checked: msgspec puts the tag first in array_like structs.
    raw = msgspec.msgpack.decode(encode([removed([5])], Form.ARRAY))
    assert raw[1][0][:3] == ["BlockRemoved", [5], "GPU"]
    raw = msgspec.msgpack.decode(encode([removed([5])], Form.MAP))
    assert raw["events"][0]["type"] == "BlockRemoved"


def test_bytes_and_int_hashes_are_both_kept_as_given() -> None:
    hashes: list[int | bytes] = [b"\x00" * 32, 2**64 - 1]
    batch = decode_batch(encode([stored(hashes, b"\x01" * 32, [1, 2, 3, 4], 2)]))
    event = batch.events[0]
    assert isinstance(event, BlockStored)
    assert event.block_hashes == hashes
    assert event.parent_block_hash == b"\x01" * 32


def test_batch_without_rank_in_either_form() -> None:
    # The oldest batches had no rank field at all: [ts, events].
    oldest = msgspec.msgpack.encode([1.5, [["AllBlocksCleared"]]])
    assert decode_batch(oldest).dp_rank is None
    assert decode_batch(oldest).events == [AllBlocksCleared()]
    as_map = msgspec.msgpack.encode({"ts": 1.5, "events": []})
    assert decode_batch(as_map).dp_rank is None
    assert decode_batch(encode([], Form.MAP, dp_rank=None)).dp_rank is None


def test_oldest_block_stored_array_without_lora_name() -> None:
    # Early releases stopped after `medium` (and before that, after `lora_id`).
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockStored", [7], None, [1, 2], 2, None, "GPU"],
                ["BlockStored", [8], 7, [3, 4], 2, None],
            ],
        ]
    )
    events = decode_batch(payload).events
    assert events == [
        BlockStored(
            block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2, medium="GPU"
        ),
        BlockStored(block_hashes=[8], parent_block_hash=7, token_ids=[3, 4], block_size=2),
    ]


def test_unknown_fields_are_ignored_in_both_forms() -> None:
    as_map = msgspec.msgpack.encode(
        {
            "ts": 1.0,
            "events": [
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "future": [1]}
            ],
            "data_parallel_rank": 0,
            "new_batch_field": {"x": 1},
        }
    )
    assert decode_batch(as_map).events == [BlockRemoved(block_hashes=[1], medium="GPU")]
    # Arrays grow at the end: extra trailing elements are fields we do not know yet.
    as_array = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU", None, "later"]], 0, "x"])
    assert decode_batch(as_array).events == [BlockRemoved(block_hashes=[1], medium="GPU")]


def test_unknown_event_types_are_skipped_and_counted() -> None:
    payload = msgspec.msgpack.encode(
        {
            "ts": 1.0,
            "events": [
                {"type": "BlockPinned", "block_hashes": [1]},
                ["SomethingNew", 1, 2],
                {"type": "AllBlocksCleared"},
            ],
        }
    )
    batch = decode_batch(payload)
    assert batch.unknown_events == 2
    assert batch.events == [AllBlocksCleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1\xc1garbage",  # 0xc1 is never valid msgpack
        b"",
        msgspec.msgpack.encode("a string"),
        msgspec.msgpack.encode({"ts": "soon", "events": []}),
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [42]]),
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # no type
        msgspec.msgpack.encode([1.0, [["BlockStored", "not a list", None, [1], 1, None, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], 1.5, [1], 1, None, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0, None, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["a"], 1, None, None]]]),
        msgspec.msgpack.encode(
            [1.0, [["BlockStored", [1, 2], None, [1, 2], 1, None, None, None, [None]]]]
        ),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [True], None]]]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_message_framing() -> None:
    message = decode_message([b"kv", (2**40).to_bytes(8, "big"), encode([cleared()])])
    assert (message.topic, message.seq, message.batch.events) == (
        b"kv",
        2**40,
        [AllBlocksCleared()],
    )
    with pytest.raises(DecodeError, match="frames"):
        decode_message([b"kv", encode([])])
    with pytest.raises(DecodeError, match="8"):
        decode_message([b"kv", b"\x01", encode([])])

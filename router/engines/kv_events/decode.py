"""Decoding of the engines' KV-cache event messages into a small typed model.

What the publisher sends (vLLM, `vllm/distributed/kv_events.py`, `ZmqEventPublisher`;
SGLang copies the framing):

- One ZMQ multipart message per batch on a PUB socket: `(topic, seq, payload)`.
  `topic` is the configured topic as UTF-8 (empty by default); `seq` comes from
  `itertools.count()` per publisher, starting at 0, sent as `seq.to_bytes(8, "big")`
  (unsigned); `payload` is `msgspec.msgpack.Encoder().encode(batch)`.
- The batch is the msgspec struct `KVEventBatch(ts: float, events: [...],
  data_parallel_rank: int | None = None)`; `publish()` fills the rank with the
  publisher's own when the caller left it None, so it is normally present. Older
  releases declared the batch `array_like=True` (`[ts, events, rank?]`, the rank left
  off when None because of `omit_defaults`); the current source drops `array_like`, so the
  batch becomes a map `{"ts", "events", "data_parallel_rank"}`.
- Events are tagged msgspec structs (`tag=True`: the tag is the class name, the tag
  field `"type"`). In the older `array_like` form an event is an array whose first
  element is the tag: `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name?, extra_keys?, group_idx?, ...]`, trailing
  defaulted fields omitted. In the map form it is `{"type": "BlockStored", ...}` with
  fields at their default (None) omitted.
- `BlockStored` fields, in declaration order: `block_hashes`, `parent_block_hash`,
  `token_ids` (the tokens of exactly these blocks, concatenated), `block_size`,
  `lora_id` (deprecated), `medium`, `lora_name`, `extra_keys` (one entry per block, or
  None), `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`. Early
  releases stop after `medium` (or even after `lora_id`).
- `BlockRemoved(block_hashes, medium, group_idx=None)`, `AllBlocksCleared()`.
- Block hashes are `ExternalBlockHash = bytes | int`: ints or raw bytes depending on
  the engine, version and hash function. They are opaque keys here.

Everything is decoded with msgspec into plain Python values first and then walked by
hand: one decoder accepts both encodings, ignores unknown fields, and skips (and counts)
unknown event types. Anything else that does not fit raises `DecodeError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

BlockHash = int | bytes
"""An engine's block hash: an opaque, hashable key (int or bytes, per engine/version)."""

ExtraKey = tuple[object, ...]
"""One block's extra hash inputs (multimodal ids, LoRA name, cache salt, ...)."""

END_OF_REPLAY_SEQ = b"\xff" * 8
"""The replay socket's end marker: `(-1).to_bytes(8, "big", signed=True)`."""


class DecodeError(Exception):
    """A message that is not a KV event batch this module understands."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[ExtraKey | None] | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KvEvent]
    dp_rank: int | None
    unknown_events: int
    """Events of a type this module does not know, skipped."""


@dataclass(frozen=True)
class EventMessage:
    topic: bytes
    seq: int
    batch: EventBatch


_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()

# Positional field order of the array_like form (after the tag), per event type.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


def decode_seq(frame: bytes) -> int:
    """A publisher's sequence frame: 8 bytes, big-endian, unsigned."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes]) -> EventMessage:
    """A PUB message `(topic, seq, payload)`, decoded."""
    if len(frames) != 3:
        raise DecodeError(f"message of {len(frames)} frames, expected 3 (topic, seq, payload)")
    topic, seq_frame, payload = frames
    return EventMessage(topic=bytes(topic), seq=decode_seq(seq_frame), batch=decode_batch(payload))


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack `KVEventBatch` in either encoding (array or map, events as tagged
    arrays or maps), with or without the DP rank."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    fields = _fields(raw, _BATCH_FIELDS, "batch")
    ts = fields.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise DecodeError("batch has no numeric ts")
    raw_events = fields.get("events")
    if not isinstance(raw_events, list):
        raise DecodeError("batch events is not a list")
    dp_rank = _optional_int(fields.get("data_parallel_rank"), "data_parallel_rank")
    events: list[KvEvent] = []
    unknown = 0
    for raw_event in raw_events:
        event = _decode_event(raw_event)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(ts=float(ts), events=events, dp_rank=dp_rank, unknown_events=unknown)


def _decode_event(raw: object) -> KvEvent | None:
    """One event, or None for a well-formed event of a type we do not know."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise DecodeError("array event without a leading type tag")
        tag: str = raw[0]
        body: object = raw[1:]
    elif isinstance(raw, dict):
        found = raw.get("type")
        if not isinstance(found, str):
            raise DecodeError("map event without a string 'type'")
        tag = found
        body = raw
    else:
        raise DecodeError(f"event is a {type(raw).__name__}, expected an array or a map")
    if tag == "BlockStored":
        return _block_stored(_fields(body, _STORED_FIELDS, tag))
    if tag == "BlockRemoved":
        fields = _fields(body, _REMOVED_FIELDS, tag)
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes")),
            medium=_optional_str(fields.get("medium"), "medium"),
            group_idx=_optional_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _block_stored(fields: dict[str, object]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise DecodeError("BlockStored parent_block_hash is neither int nor bytes")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise DecodeError("BlockStored token_ids is not a list of ints")
    block_size = fields.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise DecodeError("BlockStored block_size is not a positive int")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,  # type: ignore[arg-type]  # checked by _is_hash
        token_ids=tokens,
        block_size=block_size,
        lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
        lora_id=_optional_int(fields.get("lora_id"), "lora_id"),
        extra_keys=_extra_keys(fields.get("extra_keys"), len(hashes)),
        medium=_optional_str(fields.get("medium"), "medium"),
        group_idx=_optional_int(fields.get("group_idx"), "group_idx"),
    )


def _fields(raw: object, names: tuple[str, ...], what: str) -> dict[str, object]:
    """Named fields of a struct in array form (positional, trailing ones optional, extra
    ones ignored) or map form (unknown keys ignored)."""
    if isinstance(raw, dict):
        return {name: raw[name] for name in names if name in raw}
    if isinstance(raw, list):
        return dict(zip(names, raw, strict=False))
    raise DecodeError(f"{what} is a {type(raw).__name__}, expected an array or a map")


def _is_hash(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, bytes)


def _hashes(raw: object) -> list[BlockHash]:
    if not isinstance(raw, list) or not all(_is_hash(h) for h in raw):
        raise DecodeError("block_hashes is not a list of ints or bytes")
    return raw


def _extra_keys(raw: object, blocks: int) -> list[ExtraKey | None] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != blocks:
        raise DecodeError("extra_keys is not a list with one entry per block")
    keys: list[ExtraKey | None] = []
    for entry in raw:
        if entry is None:
            keys.append(None)
        elif isinstance(entry, list):
            # msgpack has no tuple: the engine's tuple arrives as an array.
            keys.append(tuple(_freeze(item) for item in entry))
        else:
            raise DecodeError("an extra_keys entry is neither an array nor nil")
    return keys


def _freeze(value: object) -> object:
    """Nested arrays as tuples, so an extra key is hashable and compares by value."""
    if isinstance(value, list):
        return tuple(_freeze(item) for item in value)
    if isinstance(value, dict):
        raise DecodeError("a map inside extra_keys")
    return value


def _optional_int(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{name} is not an int")
    return value


def _optional_str(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise DecodeError(f"{name} is not a string")
    return value

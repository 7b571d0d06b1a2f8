"""An engine's own load per DP rank, from `/metrics`, SGLang's `/v1/loads` and its pushed
load stream: every unusable value is unknown (left out), never zero."""

from __future__ import annotations

import math

import msgspec
import pytest

from router.engines.load_readings import (
    BadReading,
    RankReading,
    load_message,
    loads_readings,
    metrics_readings,
    server_load_count,
    whole_engine,
)

VLLM_DP2 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1234.0
"""

SGLANG = """\
sglang:num_running_reqs{model_name="m",dp_rank="0"} 4
sglang:num_queue_reqs{model_name="m",dp_rank="0"} 1
sglang:token_usage{model_name="m",dp_rank="0"} 0.1
"""


def test_vllm_per_engine_core_with_kv_usage_and_nothing_of_the_lookalike_families() -> None:
    readings = metrics_readings(VLLM_DP2, "vllm")
    assert readings == {
        0: RankReading(running=3.0, waiting=2.0, kv_usage=0.25),
        1: RankReading(running=1.0, waiting=0.0, kv_usage=0.5),
    }
    assert whole_engine(readings, dp_size=2) == RankReading(4.0, 2.0, 0.5)


def test_sglang_ranks_and_an_engine_of_unknown_kind_read_by_whichever_names_it_has() -> None:
    assert metrics_readings(SGLANG, "sglang") == {0: RankReading(4.0, 1.0, 0.1)}
    assert metrics_readings(SGLANG, None) == {0: RankReading(4.0, 1.0, 0.1)}
    assert metrics_readings(VLLM_DP2, None)[0].total == 5.0


@pytest.mark.parametrize(
    "value", ["NaN", "+Inf", "-1", "-Inf"], ids=["nan", "inf", "negative", "minus-inf"]
)
def test_an_unusable_count_leaves_that_rank_unknown(value: str) -> None:
    text = VLLM_DP2.replace(
        'vllm:num_requests_running{engine="1",model_name="tiny"} 1.0',
        f'vllm:num_requests_running{{engine="1",model_name="tiny"}} {value}',
    )
    readings = metrics_readings(text, "vllm")
    assert set(readings) == {0}
    assert whole_engine(readings, dp_size=2) is None  # a busy rank never hides


def test_a_missing_gauge_leaves_its_ranks_unknown_and_no_gauge_at_all_is_bad() -> None:
    only_running = "\n".join(
        line for line in VLLM_DP2.splitlines() if "num_requests_waiting{" not in line
    )
    assert metrics_readings(only_running, "vllm") == {}
    with pytest.raises(BadReading):
        metrics_readings("# nothing here\nother_metric 1\n", "vllm")
    with pytest.raises(BadReading):
        metrics_readings(SGLANG, "vllm")  # the names of another engine


def test_garbage_in_the_families_read_is_bad_and_outside_them_is_ignored() -> None:
    with pytest.raises(BadReading):
        metrics_readings('vllm:num_requests_running{engine="0" 3\n', "vllm")
    assert metrics_readings("garbage {{{ line\n" + VLLM_DP2, "vllm")[0].running == 3.0


def test_a_rank_label_that_is_no_number_is_left_out() -> None:
    odd = 'vllm:num_requests_running{engine="x"} 1\nvllm:num_requests_waiting{engine="x"} 1\n'
    assert metrics_readings(VLLM_DP2 + odd, "vllm").keys() == {0, 1}
    with pytest.raises(BadReading):
        metrics_readings(odd, "vllm")  # nothing left to read


def test_sglang_loads_answer() -> None:
    body = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 3, "token_usage": 0.5},
            {"dp_rank": 1, "num_running_reqs": -1, "num_waiting_reqs": 0},
            {"dp_rank": 2, "num_running_reqs": True, "num_waiting_reqs": 0},
            {"dp_rank": "3", "num_running_reqs": 1, "num_waiting_reqs": 0},
            "junk",
            {"dp_rank": 4, "num_running_reqs": 1.0, "num_waiting_reqs": 0, "token_usage": 7},
        ]
    }
    assert loads_readings(body) == {
        0: RankReading(2.0, 3.0, 0.5),
        4: RankReading(1.0, 0.0, None),
    }
    for bad in ({}, {"loads": {}}, [], None, "x"):
        with pytest.raises(BadReading):
            loads_readings(bad)


def _frames(stat: object, seq: int = 7) -> list[bytes]:
    return [b"load", seq.to_bytes(8, "big"), msgspec.msgpack.encode(stat)]


def test_a_pushed_load_stat() -> None:
    seq, reading = load_message(_frames(["LoadStat", 3, 1, 512, 2048, 0]))
    assert seq == 7 and reading == RankReading(3.0, 1.0, 0.25)
    # The trailing rank may be null; a capacity of 0 (unknown) gives no usage.
    assert load_message(_frames(["LoadStat", 0, 0, 0, 0, None]))[1].kv_usage is None


@pytest.mark.parametrize(
    "frames",
    [
        [b"load", b"\x00" * 8],
        [b"load", b"\x00" * 4, msgspec.msgpack.encode(["LoadStat", 1, 1, 0, 0, 0])],
        [b"load", b"\x00" * 8, b"\xc1"],
        _frames({"num_running_reqs": 1}),
        _frames(["KVEventBatch", 1, 1, 0, 0, 0]),
        _frames(["LoadStat", -2, 1, 0, 0, 0]),
        _frames(["LoadStat", 1, math.nan, 0, 0, 0]),
        _frames(["LoadStat", 1]),
    ],
)
def test_a_pushed_message_that_is_not_a_load_stat_is_bad(frames: list[bytes]) -> None:
    with pytest.raises(BadReading):
        load_message(frames)


def test_the_whole_engine_needs_every_rank() -> None:
    one = RankReading(1.0, 1.0)
    assert whole_engine({0: one}, dp_size=2) is None
    assert whole_engine({}, dp_size=1) is None
    assert whole_engine({0: one, 1: one}, dp_size=2) == RankReading(2.0, 2.0, None)


def test_vllm_server_load_count() -> None:
    assert server_load_count({"server_load": 3}) == 3.0
    assert server_load_count({"server_load": 0}) == 0.0


@pytest.mark.parametrize(
    "body",
    [
        {"server_load": -1},  # a counter that lost track
        {"server_load": float("nan")},
        {"server_load": True},
        {"server_load": "3"},
        {"load": 3},
        [3],
        None,
    ],
    ids=["negative", "nan", "bool", "text", "other-key", "list", "null"],
)
def test_a_load_answer_without_a_usable_count_is_bad(body: object) -> None:
    with pytest.raises(BadReading):
        server_load_count(body)

from __future__ import annotations

from collections.abc import Mapping

import pytest

from router.engines.metrics import (
    ENGINE_METRICS,
    ENGINES,
    EngineLoad,
    metric_names,
    parse_engine_load,
)


def sglang_text(
    running: tuple[str, ...] = ("0", "0", "0", "0"),
    queued: tuple[str, ...] = ("0", "0", "0", "0"),
    token_usage: tuple[str, ...] = ("0.0", "0.0", "0.0", "0.0"),
    pd: Mapping[str, tuple[str, ...]] | None = None,
) -> str:
    """A /metrics page shaped like SGLang's with --enable-metrics, one series per DP rank."""

    def gauge(name: str, help_text: str, values: tuple[str, ...]) -> str:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [
            f'{name}{{dp_rank="{rank}",engine_type="unified",model_name="qwen3-8b",'
            f'pp_rank="0",tp_rank="0"}} {value}'
            for rank, value in enumerate(values)
        ]
        return "\n".join(lines)

    parts = [
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE sglang:prompt_tokens_total counter",
        'sglang:prompt_tokens_total{model_name="qwen3-8b"} 1234.0',
        'sglang:prompt_tokens_created{model_name="qwen3-8b"} 1.7e9',
        "# HELP sglang:time_to_first_token_seconds Histogram of time to first token.",
        "# TYPE sglang:time_to_first_token_seconds histogram",
        'sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="qwen3-8b"} 3.0',
        'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="qwen3-8b"} 5.0',
        'sglang:time_to_first_token_seconds_sum{model_name="qwen3-8b"} 0.9',
        'sglang:time_to_first_token_seconds_count{model_name="qwen3-8b"} 5.0',
        gauge("sglang:num_running_reqs", "The number of running requests.", running),
        gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", queued),
        gauge("sglang:token_usage", "The token usage.", token_usage),
    ]
    for name, values in (pd or {}).items():
        parts.append(gauge(name, "PD queue.", values))
    return "\n".join(parts) + "\n"


def vllm_text(
    running: tuple[str, ...] = ("0", "0"),
    waiting: tuple[str, ...] = ("0", "0"),
    kv: Mapping[str, tuple[str, ...]] | None = None,
) -> str:
    """A /metrics page shaped like vLLM's V1 engine, one series per engine index."""

    def gauge(name: str, values: tuple[str, ...]) -> list[str]:
        return [f"# HELP {name} {name}.", f"# TYPE {name} gauge"] + [
            f'{name}{{engine="{index}",model_name="Qwen/Qwen3-8B"}} {value}'
            for index, value in enumerate(values)
        ]

    lines = [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 7.0',
        'vllm:request_success_created{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 1.7e9',
    ]
    lines += gauge("vllm:num_requests_running", running)
    lines += gauge("vllm:num_requests_waiting", waiting)
    for name, values in (kv if kv is not None else {"vllm:kv_cache_usage_perc": ("0.1",)}).items():
        lines += gauge(name, values)
    return "\n".join(lines) + "\n"


PD_GAUGES = ENGINE_METRICS["sglang"].handoff


def test_sglang_sums_every_rank() -> None:
    load = parse_engine_load(
        sglang_text(running=("1", "2", "0", "3"), queued=("0", "4", "0", "0")), "sglang"
    )
    assert load == EngineLoad(running=6.0, queued=4.0, handoff=0.0, kv_usage=0.0)
    assert load.total == 10.0


def test_one_busy_rank_of_four_shows_in_the_total() -> None:
    load = parse_engine_load(sglang_text(running=("0", "0", "0", "1")), "sglang")
    assert load.running == 1.0
    assert load.total == 1.0


def test_all_ranks_idle_reads_zero_not_none() -> None:
    load = parse_engine_load(sglang_text(), "sglang")
    assert load.total == 0.0


def test_kv_usage_is_the_fullest_rank() -> None:
    load = parse_engine_load(sglang_text(token_usage=("0.1", "0.9", "0.2", "0.0")), "sglang")
    assert load.kv_usage == 0.9


def test_colon_names_and_other_families_do_not_leak_in() -> None:
    # Counters, histograms and their _created/_bucket samples share the prefix; none of
    # them may be added to a work gauge.
    text = sglang_text(running=("2", "0", "0", "0"))
    text += 'sglang:num_running_reqs_created{dp_rank="0"} 1.7e9\n'
    load = parse_engine_load(text, "sglang")
    assert load.running == 2.0
    assert load.total == 2.0


def test_missing_required_gauge_is_unknown() -> None:
    text = "\n".join(
        line
        for line in sglang_text(running=("3",) * 4).splitlines()
        if "num_queue_reqs" not in line
    )
    load = parse_engine_load(text, "sglang")
    assert load.running == 12.0
    assert load.queued is None
    assert load.total is None


def test_empty_page_is_unknown() -> None:
    load = parse_engine_load("", "sglang")
    assert load == EngineLoad(running=None, queued=None, handoff=0.0, kv_usage=None)
    assert load.total is None


def test_pd_queues_are_summed_into_handoff_and_total() -> None:
    pd = {
        PD_GAUGES[0]: ("1", "0", "0", "0"),
        PD_GAUGES[1]: ("0", "2", "0", "0"),
        PD_GAUGES[2]: ("0", "0", "0", "0"),
        PD_GAUGES[3]: ("0", "0", "0", "4"),
    }
    load = parse_engine_load(sglang_text(pd=pd), "sglang")
    assert load.running == 0.0
    assert load.queued == 0.0
    assert load.handoff == 7.0
    assert load.total == 7.0


def test_pd_queues_alone_keep_a_prefill_worker_busy() -> None:
    # No running, no queued, one KV transfer still outstanding on one rank.
    pd = {name: ("0", "0", "0", "0") for name in PD_GAUGES}
    pd[PD_GAUGES[1]] = ("0", "0", "1", "0")
    load = parse_engine_load(sglang_text(pd=pd), "sglang")
    assert load.total == 1.0


def test_some_pd_gauges_absent_is_fine() -> None:
    load = parse_engine_load(sglang_text(pd={PD_GAUGES[3]: ("2", "0", "0", "0")}), "sglang")
    assert load.handoff == 2.0
    assert load.total == 2.0


def test_nan_pd_gauge_makes_the_reading_unknown() -> None:
    pd = {PD_GAUGES[0]: ("0", "NaN", "0", "0")}
    load = parse_engine_load(sglang_text(pd=pd), "sglang")
    assert load.handoff is None
    assert load.total is None


@pytest.mark.parametrize("bad", ["NaN", "+Inf"])
def test_non_finite_in_one_rank_is_unknown(bad: str) -> None:
    load = parse_engine_load(sglang_text(running=("0", bad, "0", "0")), "sglang")
    assert load.running is None
    assert load.queued == 0.0
    assert load.total is None


def test_nan_kv_usage_is_none_but_work_still_reads() -> None:
    load = parse_engine_load(sglang_text(token_usage=("NaN", "0", "0", "0")), "sglang")
    assert load.kv_usage is None
    assert load.total == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>404 Not Found</body></html>",
        "garbage {{{ not metrics",
        "sglang:num_running_reqs abc\n",
        # Valid up to the last line: nothing read before the failure may be kept.
        sglang_text() + 'sglang:num_running_reqs{dp_rank="9" 1\n',
    ],
)
def test_text_that_does_not_parse_is_all_unknown(text: str) -> None:
    load = parse_engine_load(text, "sglang")
    assert load == EngineLoad(running=None, queued=None, handoff=None, kv_usage=None)
    assert load.total is None


def test_vllm_sums_engines() -> None:
    load = parse_engine_load(vllm_text(running=("2", "1"), waiting=("0", "5")), "vllm")
    assert load == EngineLoad(running=3.0, queued=5.0, handoff=0.0, kv_usage=0.1)
    assert load.total == 8.0


def test_vllm_current_kv_name() -> None:
    text = vllm_text(kv={"vllm:kv_cache_usage_perc": ("0.25", "0.5")})
    assert parse_engine_load(text, "vllm").kv_usage == 0.5


def test_vllm_older_kv_name() -> None:
    text = vllm_text(kv={"vllm:gpu_cache_usage_perc": ("0.75",)})
    assert parse_engine_load(text, "vllm").kv_usage == 0.75


def test_vllm_prefers_the_current_kv_name_when_both_exist() -> None:
    text = vllm_text(
        kv={"vllm:gpu_cache_usage_perc": ("0.75",), "vllm:kv_cache_usage_perc": ("0.25",)}
    )
    assert parse_engine_load(text, "vllm").kv_usage == 0.25


def test_vllm_without_kv_gauge_still_reads_work() -> None:
    load = parse_engine_load(vllm_text(running=("1", "0"), kv={}), "vllm")
    assert load.kv_usage is None
    assert load.total == 1.0


def test_missing_vllm_waiting_gauge_is_unknown() -> None:
    text = "\n".join(line for line in vllm_text().splitlines() if "waiting" not in line)
    load = parse_engine_load(text, "vllm")
    assert load.running == 0.0
    assert load.queued is None
    assert load.total is None


def test_sglang_page_read_as_vllm_is_unknown() -> None:
    assert parse_engine_load(sglang_text(), "vllm").total is None


def test_mapping_is_closed_and_marks_required_names() -> None:
    assert ENGINES == {"sglang", "vllm"}
    assert metric_names("sglang").required == ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    assert metric_names("vllm").required == (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    )
    assert len(metric_names("sglang").optional) == 4
    assert metric_names("vllm").optional == ()


def test_unknown_engine_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'atom'.*sglang, vllm"):
        parse_engine_load(sglang_text(), "atom")

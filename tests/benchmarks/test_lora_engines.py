"""The pure parts of `python -m bench --lora-engines`: the request mix every contender
gets, the figures of a run, and the docs block."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.lora_engines import (
    ADAPTERS,
    END,
    ENGINE_404,
    HOLDINGS,
    MODEL,
    START,
    LoraRun,
    Mix,
    Seen,
    markdown,
    sample_sum,
)
from bench.procs import BenchError


def test_the_mix_is_the_same_for_every_contender_and_spreads_over_every_model() -> None:
    mix = Mix(clients=6, requests=40)
    first = [mix.models(client) for client in range(mix.clients)]
    assert first == [mix.models(client) for client in range(mix.clients)]
    counts = Counter(model for models in first for model in models)
    assert set(counts) == {MODEL, *ADAPTERS}
    assert 0.4 < counts[MODEL] / mix.total < 0.6
    assert mix.prompt(0, 0) != mix.prompt(0, 1) and len(mix.prompt(2, 3)) <= mix.prompt_chars


def test_each_adapter_is_held_by_two_engines_each_holding_two() -> None:
    assert all(len(set(held)) == 2 for held in HOLDINGS)
    assert Counter(name for held in HOLDINGS for name in held) == {name: 2 for name in ADAPTERS}


def test_a_run_reads_its_figures_and_the_block_shows_them() -> None:
    seen = Seen(ttft_base_s=[0.1, 0.3], ttft_adapter_s=[0.2, 0.4, 2.0])
    seen.statuses.update({"base 200": 2, "adapter 200": 3, "adapter 404": 1})
    one = LoraRun.of("ours least_load", seen, 2.0, 0, 0.0, [2, 2, 1])
    assert (one.requests, one.requests_per_s) == (6, 2.5)  # 5 answered in 2 s
    assert (one.adapter_p50_ms, one.adapter_p99_ms, one.base_p99_ms) == (400.0, 2000.0, 300.0)
    header = {
        "command": "python -m bench --lora-engines",
        "cpus": "2",
        "cpu_model": "cpu",
        "load_at_start": "0.1",
        "wall_min": "9.0",
        "engines": "3",
        "model": "tiny-model",
        "max_loras": "1",
        "holdings": "engine 0: a+b",
    }
    block = markdown([one], header, Mix())
    assert block.startswith(START) and block.rstrip().endswith(END)
    assert "| ours least_load | 2.5 | 300.0 | 2000.0 | 400.0 | 2000.0 |" in block
    assert "adapter 404: 1" in block and "| 2/2/1 |" in block


def test_an_engine_404_is_counted_from_its_access_log_line() -> None:
    log = (
        'INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 404 Not Found\n'
        'INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        'INFO:     127.0.0.1:5 - "GET /v1/models HTTP/1.1" 404 Not Found\n'
    )
    assert len(ENGINE_404.findall(log)) == 1


def test_a_missing_counter_is_an_error_not_a_zero() -> None:
    page = 'vllm:request_success_total{reason="stop"} 3.0\nvllm:request_success_total{reason="length"} 4.0\n'
    assert sample_sum(page, "vllm:request_success_total") == 7.0
    with pytest.raises(BenchError):
        sample_sum(page, "router_adapter_misses_total")

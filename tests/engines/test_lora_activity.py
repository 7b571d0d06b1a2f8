"""vLLM's `vllm:lora_requests_info`: the newest series is the engine's adapter slots."""

from __future__ import annotations

from router.engines.lora_activity import adapter_activity
from router.fleet.adapters import AdapterActivity

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters=""} 1.7650000105e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="b",waiting_lora_adapters="a,c"} 1.7650000201e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.7650000009e+09
"""


def test_the_newest_series_is_the_engines_state_and_stale_ones_are_ignored() -> None:
    assert adapter_activity(PAGE) == AdapterActivity(
        max_loras=1, running=frozenset({"b"}), waiting=frozenset({"a", "c"})
    )


def test_an_engine_without_lora_or_with_an_unreadable_gauge_is_unknown() -> None:
    assert adapter_activity(PAGE.split("# HELP vllm:lora")[0]) is None
    assert adapter_activity(PAGE.replace('max_lora="1"', 'max_lora="x"')) is None
    assert adapter_activity('vllm:lora_requests_info{max_lora="1" garbage\n') is None

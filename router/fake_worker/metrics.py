"""A fake worker's `/metrics`: Prometheus text with the engine's own metric names.

Rendered straight from the live per-rank load (no registry: it is scraped rarely and the
values already live in `RoutingStats`). Names and labels follow the real engines:
SGLang labels each series with `model_name` and, under DP, `dp_rank`; vLLM labels every
series with `model_name` and `engine` (its engine core's index: `"0"` without DP, one
value per DP rank with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.fake_worker.stats import RankLoad

# (name, type, help) per family; values come from `_value`.
_SGLANG_COMMON = (
    ("sglang:num_running_reqs", "gauge", "The number of running requests."),
    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue."),
    ("sglang:token_usage", "gauge", "The token usage (fraction of the KV cache in use)."),
    ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate."),
)
_SGLANG_PREFILL = (
    ("sglang:num_prefill_bootstrap_queue_reqs", "gauge", "Requests waiting for KV bootstrap."),
    ("sglang:num_prefill_inflight_queue_reqs", "gauge", "Requests whose KV is being sent."),
)
_SGLANG_DECODE = (
    ("sglang:num_decode_prealloc_queue_reqs", "gauge", "Requests waiting for KV preallocation."),
    ("sglang:num_decode_transfer_queue_reqs", "gauge", "Requests whose KV is being received."),
)
_VLLM = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in queried tokens."),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in cached tokens."),
)


def _value(name: str, load: RankLoad, capacity: int) -> float:
    if name.endswith(("num_running_reqs", "num_requests_running")):
        return float(load.running)
    if name.endswith(("num_queue_reqs", "num_requests_waiting")):
        return float(load.queued)
    if name.endswith(("token_usage", "kv_cache_usage_perc")):
        return min(1.0, load.running / capacity)
    if name.endswith("cache_hit_rate"):
        return load.cached_tokens / load.prompt_tokens if load.prompt_tokens else 0.0
    if name.endswith("prefix_cache_queries_total"):
        return float(load.prompt_tokens)
    if name.endswith("prefix_cache_hits_total"):
        return float(load.cached_tokens)
    if name.endswith("prompt_tokens_total"):
        return float(load.prompt_tokens)
    if name.endswith("generation_tokens_total"):
        return float(load.generation_tokens)
    return 0.0  # PD handoff queues: no KV moves here, so nothing ever waits in them


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(
    engine: str,
    role: str,
    model: str,
    loads: Sequence[RankLoad],
    capacity: int,
    lora: tuple[int, Sequence[tuple[str, str, float]]] | None = None,
) -> bytes:
    """The exposition text for the current load; one series per DP rank when there are several.

    `capacity` is the request count that means a full KV cache (for the usage gauge).
    `lora`: an engine serving LoRA adapters (vLLM only), its `max_loras` and the
    `vllm:lora_requests_info` series to show (`router.fake_worker.lora`: running and
    waiting adapters, each series' time).
    """
    families: tuple[tuple[str, str, str], ...]
    if engine == "vllm":
        families = _VLLM
        rank_label = "engine"
    else:
        families = _SGLANG_COMMON
        if role == "prefill":
            families += _SGLANG_PREFILL
        elif role == "decode":
            families += _SGLANG_DECODE
        rank_label = "dp_rank"
    base = f'model_name="{_escape(model)}"'
    if engine == "vllm":
        labels = [f'{{{rank_label}="{rank}",{base}}}' for rank in range(len(loads))]
    elif len(loads) > 1:
        labels = [f'{{{base},{rank_label}="{rank}"}}' for rank in range(len(loads))]
    else:
        labels = [f"{{{base}}}"]
    lines: list[str] = []
    for name, kind, help_text in families:
        # The exposition format names a counter family without its _total suffix.
        family = name.removesuffix("_total") if kind == "counter" else name
        lines.append(f"# HELP {family} {help_text}")
        lines.append(f"# TYPE {family} {kind}")
        for label, load in zip(labels, loads, strict=True):
            lines.append(f"{name}{label} {_value(name, load, capacity)!r}")
    if lora is not None and engine == "vllm":
        max_loras, series = lora
        lines.append("# HELP vllm:lora_requests_info Running stats on lora requests.")
        lines.append("# TYPE vllm:lora_requests_info gauge")
        for running, waiting, at in series:
            lora_labels = (
                f'max_lora="{max_loras}",running_lora_adapters="{_escape(running)}",'
                f'waiting_lora_adapters="{_escape(waiting)}"'
            )
            lines.append(f"vllm:lora_requests_info{{{lora_labels}}} {at!r}")
    lines.append("")
    return "\n".join(lines).encode()

"""An engine's LoRA adapter slots, from vLLM's `vllm:lora_requests_info` on its `/metrics`.

vLLM keeps one series of that gauge per combination of its labels: `max_lora` (its
`--max-loras`), `running_lora_adapters` and `waiting_lora_adapters` (adapter names,
comma-separated, empty for none). The value is the time the series was last set, and old
series are never removed: the newest one is the engine's state. In vLLM 0.32 both labels
name the same set, the adapters with a request in flight that has been scheduled at least
once (a request still waiting for its first step has told the metrics nothing yet), so
`running` is what decides; `waiting` is read as the label says, for engines that fill it
apart. An engine run without LoRA exports no such gauge; its slots are unknown (None),
never "no adapter running".

Read by the engine load reader on the page it already fetched (`router.engines.
load_reader`), so an engine's `/metrics` is polled once for both.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from router.fleet.adapters import AdapterActivity

LORA_INFO = "vllm:lora_requests_info"


def adapter_activity(text: str) -> AdapterActivity | None:
    """The newest `vllm:lora_requests_info` series of a Prometheus exposition as the
    engine's adapter slots; None when there is none, or none that can be read (no usable
    `max_lora`, a page that does not parse)."""
    series = LORA_INFO + "{"
    start = text.find(series)
    if start < 0:
        return None
    lines = [line for line in text[start:].splitlines() if line.startswith(series)]
    newest: tuple[float, dict[str, str]] | None = None
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name != LORA_INFO or not math.isfinite(sample.value):
                    continue
                if newest is None or sample.value > newest[0]:
                    newest = (sample.value, sample.labels)
    except ValueError:
        return None
    if newest is None:
        return None
    labels = newest[1]
    try:
        max_loras = int(labels.get("max_lora", ""))
    except ValueError:
        return None
    if max_loras < 1:
        return None
    return AdapterActivity(
        max_loras=max_loras,
        running=_names(labels.get("running_lora_adapters", "")),
        waiting=_names(labels.get("waiting_lora_adapters", "")),
    )


def _names(value: str) -> frozenset[str]:
    return frozenset(name for name in value.split(",") if name)

"""What a request for a LoRA adapter costs on each engine that holds it, beyond its load.

An engine runs at most `--max-loras` adapters at once (vLLM); a request for another one
waits in its queue until a slot frees, so one engine given several adapters serialises
them while another that runs the adapter already would have taken it into its batch at
once. Among the engines that hold the adapter (the plan has only those), a request is
best sent to one running it, then to one with a free slot, then to one where it waits
(`router.fleet.adapters.SlotState`). The cost of each standing is in the load policies'
unit, requests in flight, so it adds to the load figure (`Worker.load`) and to
`kv_aware`'s prefix score: a free slot costs `slot_cost` (the adapter is swapped in), a
wait `wait_cost` (a slot must drain first). An engine whose slots are unknown (its
`/metrics` not read, an engine that does not publish them) costs `slot_cost`, between
the two, never the best. The defaults are a reasoned start, not a measured optimum: a
swap-in is about one request's worth of delay, a wait about a batch's; the benchmark in
docs/policies.md ("LoRA adapters") ran with them and did not sweep them.

Pure and synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.fleet.adapters import SlotState
from router.fleet.registry import Worker


@dataclass(frozen=True, slots=True)
class AdapterAffinitySettings:
    slot_cost: float = 1.0
    """A request sent to an engine with a free adapter slot, not running the adapter."""
    wait_cost: float = 4.0
    """A request sent to an engine whose slots all run other adapters."""

    def __post_init__(self) -> None:
        if not 0 <= self.slot_cost <= self.wait_cost:
            raise ValueError(
                f"adapter costs must be 0 <= slot cost ({self.slot_cost!r}) <= wait cost "
                f"({self.wait_cost!r})"
            )


def adapter_cost(worker: Worker, adapter: str, settings: AdapterAffinitySettings) -> float:
    """What sending a request for `adapter` to `worker` costs beyond its load: 0 when the
    worker runs it (or serves the name as a model of its own), else as the module says."""
    adapters = worker.adapters
    if adapter not in adapters.held:
        return 0.0
    state = adapters.slot_state(adapter)
    if state is SlotState.RUNNING:
        return 0.0
    if state is SlotState.WAITS:
        return settings.wait_cost
    return settings.slot_cost

"""A fake worker's LoRA adapters, served as vLLM serves them.

- Which adapters it holds: the live `Behaviour.lora_adapters` (from `--lora-adapters`,
  changed by `POST /debug/behaviour`, and with `--runtime-lora-updating` by vLLM's
  `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`). `/v1/models` lists each
  after the base model with `parent` naming it; a request naming an adapter it does not
  hold is vLLM's 404 `NotFoundError` (`param` "model").
- Its adapter slots (`AdapterSlots`): at most `--max-loras` adapters run at once. A
  request for an adapter that runs already joins at once; one for another adapter takes
  a free slot, or waits (counted as waiting) until every request of some running adapter
  has ended. Requests for the base model take no slot. Later requests for a running
  adapter overtake waiting ones of another, as in vLLM's scheduler, which skips a
  waiting request whose adapter cannot be scheduled.
- `vllm:lora_requests_info` (`lora_info_series`): one series per combination of
  `max_lora`, `running_lora_adapters` and `waiting_lora_adapters` the engine has shown,
  its value the wall-clock time it was last set, old ones kept, as vLLM's gauge does.
  As vLLM 0.32 fills them, both adapter labels name the same set: the adapters of the
  requests it runs. (vLLM learns a request's adapter from its first scheduled step, so a
  request still waiting for a slot shows in neither, and every adapter it knows of goes
  in both, with its count, zero or not, of which only the names are exported.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import trio

MAX_KEPT_SERIES = 64
"""Old `lora_requests_info` series kept (vLLM keeps every one; a bound keeps a long test
from growing the page without end)."""


class AdapterSlots:
    """The adapters a fake engine runs and the ones its requests wait for."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running: dict[str, int] = {}
        """Requests running per adapter."""
        self.waiting: dict[str, int] = {}
        """Requests waiting for a slot, per adapter."""
        self._freed = trio.Event()
        self._series: OrderedDict[tuple[str, str], float] = OrderedDict()

    def can_run(self, adapter: str) -> bool:
        return adapter in self.running or len(self.running) < self.max_loras

    async def acquire(self, adapter: str) -> None:
        """Wait until `adapter` may run, and count the request running on it.

        Cancellation: the request is no longer counted waiting; it holds no slot.
        """
        if not self.can_run(adapter):
            self.waiting[adapter] = self.waiting.get(adapter, 0) + 1
            try:
                while not self.can_run(adapter):
                    await self._freed.wait()
            finally:
                left = self.waiting[adapter] - 1
                if left:
                    self.waiting[adapter] = left
                else:
                    del self.waiting[adapter]
        self.running[adapter] = self.running.get(adapter, 0) + 1

    def release(self, adapter: str) -> None:
        """One request on `adapter` ended; its slot frees when it was the last."""
        left = self.running[adapter] - 1
        if left:
            self.running[adapter] = left
            return
        del self.running[adapter]
        freed, self._freed = self._freed, trio.Event()
        freed.set()

    def lora_info_series(self, now: float) -> list[tuple[str, str, float]]:
        """`(running, waiting, set_at)` of every series to show, the current state's set
        at `now` (wall-clock seconds, as vLLM's `set_to_current_time`)."""
        names = ",".join(self.running)
        key = (names, names)
        self._series[key] = now
        self._series.move_to_end(key)
        while len(self._series) > MAX_KEPT_SERIES:
            self._series.popitem(last=False)
        return [(running, waiting, at) for (running, waiting), at in self._series.items()]


def model_cards(
    adapters: Iterable[str], parent: str, roots: dict[str, str], created: int
) -> list[dict[str, Any]]:
    """`/v1/models` entries of the adapters, as vLLM lists a loaded adapter: its path as
    `root`, `parent` the base model."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": roots.get(name, f"/adapters/{name}"),
            "parent": parent,
            "max_model_len": None,
            "permission": [],
        }
        for name in adapters
    ]

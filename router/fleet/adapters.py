"""A worker's LoRA adapters: which ones it holds, and what its engine is doing with them.

An adapter is held when the worker's record declares it, or when the engine's own model
list names it (vLLM lists each adapter with `parent`, the base model it applies to;
`router.engines.adapter_lists` reads the list while the worker is in the fleet). Both
count: the declared ones stand for engines whose list says nothing of adapters. An
adapter the engine answered 404 for (a routing miss) is held no more, even a declared
one, until the engine's list names it again.

What the engine does with them comes from vLLM's `vllm:lora_requests_info` (read with the
engine's load, `router.engines.load_reader`, which says what the labels mean): how many
adapters it may run at once (`--max-loras`), the adapters of its running requests and
those of its waiting ones.
A request for an adapter the engine is not running waits in its queue while every slot
is taken by others, so one engine serving several adapters serialises them. This
process's own requests in flight per adapter count as running: the engine's reading lags
them.

Pure and synchronous: the readers write, the policies read (`slot_state`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterActivity:
    """One reading of an engine's adapter slots (`vllm:lora_requests_info`)."""

    max_loras: int
    """Adapters the engine runs at once (`--max-loras`)."""
    running: frozenset[str]
    """Adapters of the requests it runs."""
    waiting: frozenset[str]
    """Adapters of the requests waiting in its queue."""


class SlotState(enum.IntEnum):
    """Where a request for an adapter would stand on an engine, best first."""

    RUNNING = 0
    """The engine runs the adapter already: the request joins the batch."""
    FREE_SLOT = 1
    """The engine has a free adapter slot: the adapter is swapped in, the request runs."""
    WAITS = 2
    """Every slot runs another adapter, or the adapter's requests wait already: the
    request waits until a slot frees up."""


class WorkerAdapters:
    """The adapters of one worker (the router's view; see the module docstring)."""

    __slots__ = ("_declared", "_parent", "activity", "held", "inflight", "learned", "missed")

    def __init__(self, declared: tuple[str, ...] = (), parent: str | None = None) -> None:
        self._declared = declared
        self._parent = parent
        self.learned: dict[str, str] | None = None
        """The adapters the engine's list named at the last reading (name -> base model);
        None until it was read."""
        self.missed: set[str] = set()
        """Adapters the engine answered 404 for since its list last named them."""
        self.held: dict[str, str] = {}
        """Every adapter the worker holds now, with its base model."""
        self.activity: AdapterActivity | None = None
        """The engine's adapter slots as last read; None while unknown."""
        self.inflight: dict[str, int] = {}
        """This process's requests in flight on the worker, per adapter."""
        self._recompute()

    def declare(self, declared: tuple[str, ...], parent: str | None) -> bool:
        """The record declares `declared`, applying to `parent` (its first model; None while
        its models are unknown). Returns whether the held adapters changed."""
        if declared == self._declared and parent == self._parent:
            return False
        self._declared, self._parent = declared, parent
        return self._recompute()

    def learn(self, listed: Mapping[str, str]) -> bool:
        """The engine's model list names `listed` (name -> base model). Returns whether
        the held adapters changed."""
        self.learned = dict(listed)
        self.missed.difference_update(listed)
        return self._recompute()

    def miss(self, adapter: str) -> bool:
        """The engine answered 404 for `adapter`: it holds it no more (until its list says
        so again). Returns whether the held adapters changed."""
        self.missed.add(adapter)
        if self.learned is not None:
            self.learned.pop(adapter, None)
        return self._recompute()

    def began(self, adapter: str) -> None:
        self.inflight[adapter] = self.inflight.get(adapter, 0) + 1

    def ended(self, adapter: str) -> None:
        left = self.inflight.get(adapter, 0) - 1
        if left > 0:
            self.inflight[adapter] = left
        else:
            self.inflight.pop(adapter, None)

    def slot_state(self, adapter: str) -> SlotState | None:
        """Where a request for `adapter` would stand on this engine; None while the
        engine's slots are unknown (no reading, or an engine that does not say)."""
        activity = self.activity
        if activity is None:
            return None
        if adapter in activity.running:
            return SlotState.RUNNING
        if adapter in activity.waiting:
            # Its requests wait already (an engine that names them apart from the running).
            return SlotState.WAITS
        if adapter in self.inflight:
            # Ours, sent since the reading: the engine runs it, or is about to.
            return SlotState.RUNNING
        busy = len(activity.running.union(self.inflight))
        return SlotState.FREE_SLOT if busy < activity.max_loras else SlotState.WAITS

    def _recompute(self) -> bool:
        held: dict[str, str] = {}
        if self._parent is not None:
            for name in self._declared:
                if name not in self.missed:
                    held[name] = self._parent
        if self.learned is not None:
            held.update(self.learned)
        changed = held != self.held
        self.held = held
        return changed

"""Affinity among the engines holding a LoRA adapter: one running it, then one with a
free slot, then one where it waits, each weighed against load; and kv_aware's block keys
namespaced by the adapter."""

from __future__ import annotations

import random

import pytest

from router.engines.kv_events import BlockStored
from router.engines.kv_events.fleet_views import KvIndexes
from router.fleet.adapters import AdapterActivity
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Worker
from router.policies.adapter_affinity import AdapterAffinitySettings, adapter_cost
from router.policies.kv_aware import KvAware, KvAwareSettings
from router.policies.load import LeastLoad, PowerOfTwo
from router.policies.policy import PolicyKey

COSTS = AdapterAffinitySettings(slot_cost=1.0, wait_cost=4.0)


def worker(
    worker_id: str, *, inflight: int = 0, running: set[str] | None = None, max_loras: int = 1
) -> Worker:
    record = WorkerRecord(
        id=worker_id, url=f"http://{worker_id}.test:8000", models=("base",), adapters=("a", "b")
    )
    held = Worker(record=record, inflight=inflight)
    if running is not None:
        held.adapters.activity = AdapterActivity(max_loras, frozenset(running), frozenset())
    return held


def adapter_key(model: str = "a", **extra: object) -> PolicyKey:
    return PolicyKey(model=model, role=Role.MIXED, base_model="base", **extra)  # type: ignore[arg-type]


def test_the_costs_follow_the_slots_and_unknown_is_a_free_slot() -> None:
    assert adapter_cost(worker("w", running={"a"}), "a", COSTS) == 0.0
    assert adapter_cost(worker("w", running=set()), "a", COSTS) == 1.0
    assert adapter_cost(worker("w", running={"b"}), "a", COSTS) == 4.0
    assert adapter_cost(worker("w"), "a", COSTS) == 1.0
    assert adapter_cost(worker("w", running={"b"}), "base", COSTS) == 0.0  # no adapter


def test_least_load_prefers_the_engine_running_the_adapter_over_a_lighter_one_that_would_wait() -> (
    None
):
    busy_with_a = worker("w0", inflight=2, running={"a"})
    idle_with_b = worker("w1", inflight=1, running={"b"})
    policy = LeastLoad(adapters=COSTS)
    # 2 + 0 against 1 + 4.
    assert policy.pick(adapter_key(), [idle_with_b, busy_with_a]) is busy_with_a
    # The base model takes no slot: the lighter engine.
    assert (
        policy.pick(PolicyKey(model="base", role=Role.MIXED), [idle_with_b, busy_with_a])
        is idle_with_b
    )
    # Load still wins once the gap is larger than the wait.
    busy_with_a.inflight = 6
    assert policy.pick(adapter_key(), [idle_with_b, busy_with_a]) is idle_with_b


def test_a_free_slot_beats_a_wait_and_power_of_two_weighs_the_same() -> None:
    free = worker("w0", inflight=1, running=set())
    waits = worker("w1", inflight=0, running={"b"})
    assert LeastLoad(adapters=COSTS).pick(adapter_key(), [waits, free]) is free
    assert PowerOfTwo(random.Random(0), COSTS).pick(adapter_key(), [waits, free]) is free


@pytest.mark.parametrize(("adapter", "winner"), [("a", "w1"), (None, "w0")])
def test_kv_aware_looks_up_an_adapters_blocks_in_its_own_namespace(
    adapter: str | None, winner: str
) -> None:
    indexes = KvIndexes()
    index = indexes.for_model("base")
    fleet = [worker("w0"), worker("w1")]
    for held in fleet:
        index.apply_cleared((held.id, None))
        held.adapters.activity = AdapterActivity(2, frozenset(), frozenset())
    prompt = list(range(16))
    # The same tokens, cached by w0 for the base model and by w1 for adapter a.
    index.apply(("w0", None), [BlockStored([1, 2, 3, 4], None, prompt, 4)])
    index.apply(("w1", None), [BlockStored([5, 6, 7, 8], None, prompt, 4, lora_name="a")])
    policy = KvAware(KvAwareSettings(), indexes, lambda: 0.0, adapters=COSTS)
    body = {"model": adapter or "base", "input_ids": prompt}
    key = adapter_key(body=body) if adapter else PolicyKey(model="base", role=Role.MIXED, body=body)
    assert policy.pick(key, fleet).id == winner
    assert policy.statistics()["picks_by_match"] == 1


def test_kv_aware_adds_the_adapters_cost_to_each_candidates_load() -> None:
    indexes = KvIndexes()
    index = indexes.for_model("base")
    running_b = worker("w0", running={"b"})
    running_a = worker("w1", inflight=2, running={"a"})
    for held in (running_b, running_a):
        index.apply_cleared((held.id, None))
    policy = KvAware(KvAwareSettings(), indexes, lambda: 0.0, adapters=COSTS)
    key = adapter_key(body={"model": "a", "input_ids": list(range(16))})
    assert policy.pick(key, [running_b, running_a]) is running_a

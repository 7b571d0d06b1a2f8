"""A worker's LoRA adapters (declared, learned, missed), where a request for one would
stand on its engine, and the fleet's index by adapter: what plans an adapter's requests
and what makes an unknown adapter a 404 and one whose engines are down a 503."""

from __future__ import annotations

import pytest

from router.api.errors import ModelNotFound, NoAvailableWorkers
from router.fleet.adapters import AdapterActivity, SlotState, WorkerAdapters
from router.fleet.candidates import AllOpenMode
from router.fleet.records import InvalidWorkerRecord, WorkerRecord
from router.fleet.registry import Fleet
from router.pipeline.plan import plan_request


def record(worker_id: str, *adapters: str, model: str = "base") -> WorkerRecord:
    return WorkerRecord.from_json(
        {
            "id": worker_id,
            "url": f"http://{worker_id}.test:8000",
            "model": model,
            "adapters": list(adapters),
        }
    )


def test_declared_adapters_apply_to_the_first_model_and_the_engines_list_adds_its_own() -> None:
    adapters = WorkerAdapters(("a",), "base")
    assert adapters.held == {"a": "base"}
    assert adapters.learn({"b": "base"})
    assert adapters.held == {"a": "base", "b": "base"}
    assert not adapters.learn({"b": "base"})  # the same list again changes nothing


def test_a_miss_drops_even_a_declared_adapter_until_the_engines_list_names_it_again() -> None:
    adapters = WorkerAdapters(("a",), "base")
    adapters.learn({"b": "base"})
    assert adapters.miss("a") and adapters.miss("b")
    assert adapters.held == {}
    adapters.learn({})  # still not listed: still not held
    assert adapters.held == {}
    adapters.learn({"a": "base"})
    assert adapters.held == {"a": "base"}


def test_a_declared_adapter_waits_for_the_records_models() -> None:
    adapters = WorkerAdapters(("a",), None)
    assert adapters.held == {}
    assert adapters.declare(("a",), "base")
    assert adapters.held == {"a": "base"}


@pytest.mark.parametrize(
    ("running", "waiting", "ours", "max_loras", "state"),
    [
        ({"a"}, set(), {}, 1, SlotState.RUNNING),
        (set(), set(), {}, 1, SlotState.FREE_SLOT),
        ({"b"}, set(), {}, 1, SlotState.WAITS),
        ({"b"}, set(), {}, 2, SlotState.FREE_SLOT),
        ({"a"}, {"a"}, {}, 1, SlotState.RUNNING),
        ({"b"}, {"a"}, {}, 2, SlotState.WAITS),  # its requests wait already
        (set(), set(), {"a": 1}, 1, SlotState.RUNNING),  # ours, sent since the reading
        (set(), set(), {"b": 2}, 1, SlotState.WAITS),  # ours took the one slot
    ],
)
def test_where_a_request_for_an_adapter_stands(
    running: set[str], waiting: set[str], ours: dict[str, int], max_loras: int, state: SlotState
) -> None:
    adapters = WorkerAdapters()
    adapters.activity = AdapterActivity(max_loras, frozenset(running), frozenset(waiting))
    for name, count in ours.items():
        for _ in range(count):
            adapters.began(name)
    assert adapters.slot_state("a") is state


def test_slots_are_unknown_without_a_reading_and_ours_end() -> None:
    adapters = WorkerAdapters()
    adapters.began("a")
    assert adapters.slot_state("a") is None
    adapters.ended("a")
    assert adapters.inflight == {}


def test_the_fleet_indexes_adapters_apart_from_models() -> None:
    fleet = Fleet()
    one = fleet.upsert(record("one", "a"))
    two = fleet.upsert(record("two"))
    assert one is not None and two is not None
    generation = fleet.generation
    fleet.learn_adapters(two, {"a": "base", "b": "base"})
    assert fleet.generation > generation
    assert fleet.models() == ["base"]
    assert fleet.adapters() == {"a": "base", "b": "base"}
    assert fleet.for_model("a") == [one, two] and fleet.for_model("b") == [two]
    assert fleet.adapter_parent("b") == "base" and fleet.adapter_parent("base") is None
    fleet.adapter_missed(two, "b")
    assert fleet.for_model("b") == [] and fleet.adapters() == {"a": "base"}


def test_a_record_change_keeps_what_was_learned_and_a_new_url_forgets_it() -> None:
    fleet = Fleet()
    worker = fleet.upsert(record("one"))
    assert worker is not None
    fleet.learn_adapters(worker, {"a": "base"})
    fleet.upsert(record("one", "c"))
    assert worker.adapters.held == {"a": "base", "c": "base"}
    fleet.upsert(
        WorkerRecord.from_json({"id": "one", "url": "http://elsewhere.test:1", "model": "base"})
    )
    assert worker.adapters.held == {}
    assert fleet.adapters() == {}


def test_an_adapter_nobody_holds_is_404_and_one_whose_holders_are_down_is_503() -> None:
    fleet = Fleet()
    worker = fleet.upsert(record("one", "a"))
    assert worker is not None

    def plan(model: str) -> object:
        return plan_request(model, fleet.for_model(model), 0.0, AllOpenMode.DISPATCH)

    with pytest.raises(ModelNotFound):
        plan("z")
    worker.healthy = False
    with pytest.raises(NoAvailableWorkers, match="model 'a'"):
        plan("a")


def test_a_record_cannot_declare_its_own_model_an_adapter() -> None:
    with pytest.raises(InvalidWorkerRecord, match="adapters"):
        record("one", "base")
    with pytest.raises(InvalidWorkerRecord, match="adapters"):
        WorkerRecord.from_json({"url": "http://one.test:1", "model": "m", "adapters": [3]})
    assert record("one", "a", "a").adapters == ("a",)
    assert record("one", "a").to_json()["adapters"] == ["a"]

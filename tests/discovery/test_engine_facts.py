"""Facts from the engine, pure part: what a `/get_server_info` answer makes of a record,
and how the fleet holds a worker out of routing until its facts are known."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from router.discovery.engine_facts import FactsUnavailable, complete_record
from router.discovery.static import parse_worker_spec
from router.fleet.records import Status, WorkerRecord
from router.fleet.registry import Fleet

PREFILL_INFO: dict[str, Any] = {
    "disaggregation_mode": "prefill",
    "disaggregation_bootstrap_port": 9123,
    "disaggregation_transfer_backend": "nixl",
    "dp_size": 4,
}


def learned(record: WorkerRecord, info: dict[str, Any] = PREFILL_INFO) -> WorkerRecord:
    return dataclasses.replace(complete_record(record, info), unknown_facts=frozenset())


def test_a_prefill_learns_its_bootstrap_port_protocol_and_dp_size() -> None:
    record = parse_worker_spec("http://10.0.0.7:30000,role=prefill,model=m")
    complete = learned(record)
    assert complete.bootstrap_addr == "10.0.0.7:9123"
    assert complete.disagg_meta == {
        "protocol": "nixl",
        "params": {"bootstrap_addr": "10.0.0.7:9123"},
    }
    assert complete.dp_size == 4 and complete.rank_multiplexed


def test_an_explicit_dp_size_wins_over_the_engine() -> None:
    record = parse_worker_spec("http://p:30000,role=prefill,model=m,dp_size=1")
    complete = learned(record)
    assert complete.dp_size == 1 and complete.bootstrap_addr == "p:9123"


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ([1, 2], "not a JSON object"),
        ({**PREFILL_INFO, "disaggregation_mode": "null"}, "disaggregation_mode 'null'"),
        (
            {**PREFILL_INFO, "disaggregation_bootstrap_port": None},
            "no usable disaggregation_bootstrap_port",
        ),
        (
            {**PREFILL_INFO, "disaggregation_bootstrap_port": 70000},
            "no usable disaggregation_bootstrap_port",
        ),
        (
            {**PREFILL_INFO, "disaggregation_bootstrap_port": True},
            "no usable disaggregation_bootstrap_port",
        ),
        (
            {**PREFILL_INFO, "disaggregation_bootstrap_port": "8998"},
            "no usable disaggregation_bootstrap_port",
        ),
        ({**PREFILL_INFO, "dp_size": 0}, "dp_size 0"),
        ({**PREFILL_INFO, "dp_size": "4"}, "dp_size '4'"),
    ],
)
def test_an_answer_that_cannot_be_right_is_refused_with_the_reason(info: Any, message: str) -> None:
    record = parse_worker_spec("http://p:30000,role=prefill,model=m")
    with pytest.raises(FactsUnavailable, match=message):
        complete_record(record, info)


def prefill_record(url: str = "http://p:1", **changes: Any) -> WorkerRecord:
    return dataclasses.replace(parse_worker_spec(f"{url},role=prefill,model=m,id=p"), **changes)


def test_a_worker_waits_out_of_routing_until_its_facts_are_admitted() -> None:
    fleet = Fleet()
    pokes: list[int] = []
    fleet.on_pending = lambda: pokes.append(1)
    offered = prefill_record()
    assert fleet.upsert(offered) is None
    assert fleet.for_model("m") == [] and len(fleet) == 0
    assert list(fleet.pending) == ["p"] and pokes == [1]

    worker = fleet.admit(offered, learned(offered))
    assert worker is not None and fleet.for_model("m") == [worker]
    assert worker.record.bootstrap_addr == "p:9123" and fleet.pending == {}


def test_a_known_worker_that_turns_draining_changes_at_once_without_asking_again() -> None:
    fleet = Fleet()
    pokes: list[int] = []
    offered = prefill_record()
    fleet.upsert(offered)
    fleet.admit(offered, learned(offered))
    fleet.on_pending = lambda: pokes.append(1)
    worker = fleet.upsert(dataclasses.replace(offered, status=Status.DRAINING))
    assert worker is not None and worker.draining and worker.record.bootstrap_addr == "p:9123"
    assert pokes == [] and fleet.pending == {}


def test_a_new_url_for_the_same_worker_is_asked_again_and_leaves_routing_meanwhile() -> None:
    fleet = Fleet()
    offered = prefill_record()
    fleet.upsert(offered)
    fleet.admit(offered, learned(offered))
    moved = prefill_record("http://q:1")
    assert fleet.upsert(moved) is None
    assert fleet.for_model("m") == [] and fleet.pending["p"].record == moved
    # the answer about the old address must not admit the new one
    assert fleet.admit(offered, learned(offered)) is None
    assert fleet.for_model("m") == []


def test_removal_and_relists_forget_pending_workers_and_learned_facts() -> None:
    fleet = Fleet()
    offered = prefill_record()
    fleet.upsert(offered)
    fleet.remove("p")
    assert fleet.pending == {} and fleet.admit(offered, learned(offered)) is None
    fleet.upsert(offered)
    fleet.admit(offered, learned(offered))
    fleet.replace_all([])
    assert fleet.pending == {} and len(fleet) == 0
    assert fleet.upsert(offered) is None  # learned facts were forgotten with the worker

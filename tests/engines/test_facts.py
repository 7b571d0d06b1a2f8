"""Facts from the engine, pure part: what a `/get_server_info` answer makes of a record,
how the fleet holds a worker out of routing until its facts are known, and how the
engine's kind is told from its answers while the worker routes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from router.discovery.static import parse_worker_spec
from router.engines.facts import (
    NOT_JSON,
    Answer,
    FactsUnavailable,
    complete_record,
    engine_kind,
    kv_event_endpoints,
    max_model_lens,
)
from router.fleet.records import (
    DESCRIPTIVE_FACTS,
    EventEndpoint,
    InvalidWorkerRecord,
    Status,
    WorkerRecord,
)
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


# -- the engine's kind: learned from its answers, never assumed --------------------------

SGLANG_INFO: dict[str, Any] = {"model_path": "m", "tp_size": 1, "dp_size": 1, "version": "0.5.2"}
NOT_FOUND = Answer("/server_info", 404, {"detail": "Not Found"})


@pytest.mark.parametrize(
    ("server_info", "version", "kind"),
    [
        (Answer("/get_server_info", 200, SGLANG_INFO), None, "sglang"),
        # vLLM serves neither server-info path, and `/version` with `version` only
        (NOT_FOUND, Answer("/version", 200, {"version": "0.32.0"}), "vllm"),
        # vLLM's development-mode /server_info
        (Answer("/server_info", 200, {"vllm_config": "...", "vllm_env": {}}), None, "vllm"),
        # a /version with more than vLLM's one key is some other server's
        (NOT_FOUND, Answer("/version", 200, {"version": "1", "name": "tgi"}), None),
        (NOT_FOUND, Answer("/version", 200, {"version": 32}), None),
        (NOT_FOUND, Answer("/version", 404, NOT_JSON), None),
        # a server info in another engine's shape decides against both kinds
        (Answer("/get_server_info", 200, {"status": "ready", "backend": "x"}), None, None),
        (Answer("/get_server_info", 200, {**SGLANG_INFO, "tp_size": "1"}), None, None),
        (Answer("/get_server_info", 200, NOT_JSON), None, None),
        (Answer("/get_server_info", 401, {"error": "key"}), None, None),
    ],
)
def test_the_kind_follows_the_rule_on_what_the_engine_answers(
    server_info: Answer, version: Answer | None, kind: str | None
) -> None:
    assert engine_kind(server_info, version) == kind


@pytest.mark.parametrize(
    ("server_info", "version"),
    [
        (Answer("/get_server_info", 503, NOT_JSON), None),
        (NOT_FOUND, Answer("/version", 500, NOT_JSON)),
        (NOT_FOUND, Answer("/version", 429, NOT_JSON)),
    ],
)
def test_an_engine_not_ready_to_say_decides_nothing(
    server_info: Answer, version: Answer | None
) -> None:
    with pytest.raises(FactsUnavailable, match="answered"):
        engine_kind(server_info, version)


def test_a_record_that_names_no_engine_leaves_the_kind_unknown_not_guessed() -> None:
    record = parse_worker_spec("http://w:1,model=m")
    assert record.engine is None and record.to_json()["engine"] is None
    assert record.unknown_facts == DESCRIPTIVE_FACTS
    assert parse_worker_spec("http://w:1,model=m,engine=sglang").unknown_facts == frozenset()
    vllm = WorkerRecord.from_json({"url": "http://w:1", "model": "m", "engine": "vllm"})
    assert vllm.engine == "vllm"
    assert vllm.unknown_facts == {"max_model_len", "kv_event_sources"}  # kind given: not asked
    with pytest.raises(InvalidWorkerRecord, match="'engine'"):
        WorkerRecord.from_json({"url": "http://w:1", "engine": ""})


def test_a_worker_of_unknown_kind_routes_at_once_and_takes_the_kind_once_learned() -> None:
    fleet = Fleet()
    pokes: list[int] = []
    fleet.on_pending = lambda: pokes.append(1)
    record = parse_worker_spec("http://w:1,model=m,id=w")
    worker = fleet.upsert(record)
    assert worker is not None and fleet.for_model("m") == [worker]  # the kind is not needed
    assert worker.engine is None and fleet.pending == {} and list(fleet.describing) == ["w"]
    assert pokes == [1]
    learned = dataclasses.replace(
        record,
        engine="vllm",
        max_model_len={"m": 4096},
        kv_event_sources=(EventEndpoint(0, "tcp://w:5557"),),
        unknown_facts=frozenset(),
    )
    assert fleet.describe(record, learned) is worker
    assert worker.engine == "vllm" and worker.record.max_model_len == {"m": 4096}
    assert worker.record.kv_event_sources == (EventEndpoint(0, "tcp://w:5557"),)
    assert fleet.describing == {}
    # discovery says the same again (say, DRAINING): what was learned stays, nothing is asked
    again = fleet.upsert(dataclasses.replace(record, status=Status.DRAINING))
    assert again is worker and worker.engine == "vllm" and worker.draining
    assert fleet.describing == {} and pokes == [1]


def test_an_answer_about_a_replaced_record_is_dropped() -> None:
    fleet = Fleet()
    record = parse_worker_spec("http://w:1,model=m,id=w")
    fleet.upsert(record)
    moved = parse_worker_spec("http://v:1,model=m,id=w")
    fleet.upsert(moved)
    learned = dataclasses.replace(record, engine="sglang", unknown_facts=frozenset())
    assert fleet.describe(record, learned) is None
    worker = fleet.get("w")
    assert worker is not None and worker.engine is None and fleet.describing["w"] == moved


def test_a_prefill_learned_without_its_kind_routes_and_is_described_later() -> None:
    fleet = Fleet()
    offered = prefill_record(engine=None, unknown_facts=frozenset({"bootstrap_port", "engine"}))
    fleet.upsert(offered)
    # blocking facts learned, the kind not yet (its question failed): admitted anyway
    partial = dataclasses.replace(learned(offered), unknown_facts=frozenset({"engine"}))
    worker = fleet.admit(offered, partial)
    assert worker is not None and worker.record.bootstrap_addr == "p:9123"
    assert worker.engine is None and "p" in fleet.describing


@pytest.mark.parametrize(
    ("answer", "url", "expected"),
    [
        # vLLM 0.32: an object keyed by DP rank, each its events config; `*` binds
        (
            {
                "0": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": "tcp://*:5557",
                    "replay_endpoint": "tcp://*:5558",
                    "topic": "",
                },
                "1": {"publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": None},
            },
            "http://10.0.0.9:8000",
            (
                EventEndpoint(0, "tcp://10.0.0.9:5557", "tcp://10.0.0.9:5558", ""),
                EventEndpoint(1, "tcp://10.0.0.9:5558", None, ""),
            ),
        ),
        # later releases: a list (or {"sources": [...]}) carrying the rank; a named host stays
        (
            {
                "sources": [
                    {
                        "data_parallel_rank": 0,
                        "endpoint": "tcp://10.1.1.1:41001",
                        "replay_endpoint": None,
                        "topic": "kv",
                    }
                ]
            },
            "http://w:8000",
            (EventEndpoint(0, "tcp://10.1.1.1:41001", None, "kv"),),
        ),
        (
            [{"data_parallel_rank": 0, "endpoint": "tcp://*:7000"}],
            "http://[fd00::5]:8000",
            (EventEndpoint(0, "tcp://[fd00::5]:7000"),),
        ),
        ({}, "http://w:1", ()),  # events off
        ({"0": {"publisher": "null", "endpoint": "tcp://*:1"}, "x": {}}, "http://w:1", ()),
        ("garbage", "http://w:1", ()),
    ],
)
def test_kv_event_sources_are_read_in_every_shape_with_the_workers_own_host(
    answer: Any, url: str, expected: tuple[EventEndpoint, ...]
) -> None:
    assert kv_event_endpoints(answer, url) == expected


def test_max_model_len_is_read_per_model() -> None:
    answer = {
        "data": [
            {"id": "m", "max_model_len": 2048},
            {"id": "lora", "max_model_len": 2048},
            {"id": "n"},
            {"id": "b", "max_model_len": True},
        ]
    }
    assert max_model_lens(answer) == {"m": 2048, "lora": 2048}
    assert max_model_lens({"object": "list"}) == {}

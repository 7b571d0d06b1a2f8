"""Pods as workers, pure part: selectors, candidates, annotations, and how events change
the fleet (router.discovery.kube_pods)."""

from __future__ import annotations

from typing import Any

import pytest

from router.discovery.kube_pods import (
    BadSelector,
    PodFacts,
    PodMirror,
    Selector,
    pod_record,
    pod_sources,
)
from router.fleet.records import DESCRIPTIVE_FACTS, InvalidWorkerRecord, Role
from router.fleet.registry import Fleet
from tests.support.fake_kube_api import make_pod

APP = {"app": "engine"}
MODEL = {"trio-router/model": "m", "trio-router/dp-size": "1"}


def pod(
    name: str = "w-0",
    *,
    labels: dict[str, str] = APP,
    annotations: dict[str, str] | None = None,
    **changes: Any,
) -> dict[str, Any]:
    return make_pod(
        name,
        ip=changes.pop("ip", "10.1.2.3"),
        labels=labels,
        annotations=MODEL if annotations is None else annotations,
        **changes,
    )


def terminating(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return obj


def test_selectors_parse_equality_terms_and_refuse_the_rest() -> None:
    assert str(Selector.parse("app=engine, tier==gpu")) == "app=engine,tier=gpu"
    assert Selector.parse("app=engine").matches({"app": "engine", "x": "y"})
    assert not Selector.parse("app=engine,tier=gpu").matches({"app": "engine"})
    for bad in ("app", "app!=x", "app in (a,b)", "", " , "):
        with pytest.raises(BadSelector):
            Selector.parse(bad)
    with pytest.raises(BadSelector, match="needs --k8s-selector"):
        pod_sources("", "", "")
    assert [s.role for s in pod_sources("a=1", "b=2", "c=3")] == [
        Role.PREFILL,
        Role.DECODE,
        Role.MIXED,
    ]


@pytest.mark.parametrize(
    ("changes", "candidate"),
    [
        ({}, True),
        ({"ready": False}, False),
        ({"ip": None}, False),
        ({"phase": "Pending"}, False),
        ({"phase": "Succeeded"}, False),
    ],
)
def test_a_candidate_is_running_with_an_ip_and_ready(
    changes: dict[str, Any], candidate: bool
) -> None:
    assert PodFacts.of(pod(**changes)).candidate is candidate


def test_a_terminating_pod_is_no_candidate_though_still_running_and_ready() -> None:
    facts = PodFacts.of(terminating(pod()))
    assert facts.phase == "Running" and facts.ready and facts.terminating and not facts.candidate


def test_annotations_give_port_model_role_dp_size_and_the_bootstrap_port() -> None:
    notes = {
        "trio-router/port": "30000",
        "trio-router/model": "a+b",
        "trio-router/role": "prefill",
        "trio-router/dp-size": "4",
        "sglang.ai/bootstrap-port": "9000",
        "trio-router/engine": "sglang",
        "trio-router/adapters": "x, y",
    }
    record = pod_record(PodFacts.of(pod(annotations=notes)), Role.MIXED, 8000)
    assert record.adapters == ("x", "y")
    assert (record.id, record.url, record.models) == (
        "default/w-0",
        "http://10.1.2.3:30000",
        ("a", "b"),
    )
    assert (record.role, record.dp_size, record.bootstrap_addr) == (
        Role.PREFILL,
        4,
        "10.1.2.3:9000",
    )
    assert record.unknown_facts == frozenset() and record.engine == "sglang"


def test_what_the_annotations_leave_out_is_left_to_the_engine() -> None:
    record = pod_record(PodFacts.of(pod(annotations={})), Role.PREFILL, 8000)
    assert record.url == "http://10.1.2.3:8000"
    assert record.unknown_facts == {"models", "dp_size", "bootstrap_port"} | DESCRIPTIVE_FACTS
    assert record.engine is None  # no annotation: the engine's answers will tell, no guess
    decode = pod_record(
        PodFacts.of(pod(annotations={"trio-router/engine": "vllm"})), Role.DECODE, 8000
    )
    assert decode.engine == "vllm"  # the annotation wins: the kind is not asked
    # vLLM states no DP size; it is asked only what vLLM states of itself.
    assert decode.unknown_facts == {"models", "max_model_len", "kv_event_sources"}
    assert decode.dp_size == 1
    v6 = pod_record(PodFacts.of(pod(ip="fd00::5")), Role.MIXED, 8000)
    assert v6.url == "http://[fd00::5]:8000"


def test_a_grpc_pod_is_a_grpc_worker_that_learns_its_facts_over_grpc() -> None:
    notes = {"trio-router/protocol": "grpc", "trio-router/port": "50051"}
    record = pod_record(PodFacts.of(pod(annotations=notes)), Role.MIXED, 8000)
    assert (record.url, record.is_grpc) == ("grpc://10.1.2.3:50051", True)
    # Every fact is asked of the engine service, the DP size included.
    assert record.unknown_facts == {"models", "dp_size"} | DESCRIPTIVE_FACTS


@pytest.mark.parametrize(
    ("notes", "message"),
    [
        ({"trio-router/port": "http"}, "trio-router/port must be an integer"),
        ({"trio-router/port": "70000"}, "trio-router/port must be 1-65535"),
        ({"trio-router/role": "teacher"}, "'role' must be one of"),
        ({"trio-router/dp-size": "0"}, "trio-router/dp-size must be 1-1024"),
        ({"sglang.ai/bootstrap-port": "-1"}, "sglang.ai/bootstrap-port must be 1-65535"),
        ({"trio-router/protocol": "https"}, "trio-router/protocol must be http or grpc"),
        (
            {"trio-router/protocol": "grpc", "trio-router/role": "prefill"},
            "prefill and decode workers over gRPC are not supported",
        ),
    ],
)
def test_a_bad_annotation_is_refused_with_its_name(notes: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidWorkerRecord, match=message):
        pod_record(PodFacts.of(pod(annotations={**MODEL, **notes})), Role.MIXED, 8000)


def mirror(
    prefill: str = "", decode: str = "", mixed: str = "app=engine"
) -> tuple[Fleet, PodMirror]:
    fleet = Fleet()
    sources = pod_sources(mixed, prefill, decode)
    return fleet, PodMirror(fleet, sources, 8000)


def test_terminating_drains_at_once_and_deleted_removes() -> None:
    fleet, pods = mirror()
    (source,) = pod_sources("app=engine", "", "")
    pods.relist(source, [pod("w-0"), pod("w-1")])
    assert sorted(w.id for w in fleet.workers()) == ["default/w-0", "default/w-1"]
    pods.apply(source, "MODIFIED", terminating(pod("w-0", ready=False)))
    worker = fleet.get("default/w-0")
    assert worker is not None and worker.draining  # still known, takes no new request
    pods.apply(source, "DELETED", terminating(pod("w-0")))
    assert fleet.get("default/w-0") is None


def test_not_ready_leaves_and_ready_again_joins() -> None:
    fleet, pods = mirror()
    (source,) = pod_sources("app=engine", "", "")
    pods.apply(source, "ADDED", pod("w-0"))
    pods.apply(source, "MODIFIED", pod("w-0", ready=False))
    assert len(fleet) == 0
    pods.apply(source, "MODIFIED", pod("w-0"))
    assert [w.id for w in fleet.workers()] == ["default/w-0"]


def test_a_terminating_pod_never_seen_ready_does_not_join() -> None:
    fleet, pods = mirror()
    (source,) = pod_sources("app=engine", "", "")
    pods.apply(source, "ADDED", terminating(pod("w-0")))
    assert len(fleet) == 0 and fleet.pending == {}


def test_a_relist_removes_what_is_gone_only_from_its_own_selector() -> None:
    fleet, pods = mirror(prefill="pool=p", decode="pool=d", mixed="")
    prefill_source, decode_source = pod_sources("", "pool=p", "pool=d")
    notes = {**MODEL, "sglang.ai/bootstrap-port": "9000"}
    pods.relist(prefill_source, [pod("p-0", labels={"pool": "p"}, annotations=notes)])
    pods.relist(decode_source, [pod("d-0", labels={"pool": "d"}), pod("d-1", labels={"pool": "d"})])
    assert len(fleet) == 3
    pods.relist(decode_source, [pod("d-1", labels={"pool": "d"})])
    assert sorted(w.id for w in fleet.workers()) == ["default/d-1", "default/p-0"]
    assert {w.id: w.role for w in fleet.workers()}["default/p-0"] is Role.PREFILL


def test_a_pod_matching_two_selectors_belongs_to_the_first() -> None:
    fleet, pods = mirror(prefill="app=engine", mixed="app=engine")
    prefill_source, mixed_source = pod_sources("app=engine", "app=engine", "")
    notes = {**MODEL, "sglang.ai/bootstrap-port": "9000"}
    pods.apply(mixed_source, "ADDED", pod("w-0", annotations=notes))
    assert len(fleet) == 0  # the mixed watch leaves it to the prefill one
    pods.apply(prefill_source, "ADDED", pod("w-0", annotations=notes))
    worker = fleet.get("default/w-0")
    assert worker is not None and worker.role is Role.PREFILL


def test_a_pod_whose_labels_stop_matching_leaves_and_garbage_is_skipped() -> None:
    fleet, pods = mirror()
    (source,) = pod_sources("app=engine", "", "")
    pods.apply(source, "ADDED", pod("w-0"))
    pods.apply(source, "MODIFIED", pod("w-0", labels={"app": "other"}))
    assert len(fleet) == 0
    for garbage in (None, [], {"metadata": "x"}, {"metadata": {"name": 5}}):
        pods.apply(source, "ADDED", garbage)
    pods.apply(source, "ADDED", pod("w-1", annotations={"trio-router/port": "x"}))
    assert len(fleet) == 0 and fleet.pending == {}

"""How etcd listings and watch events become the fleet, without an etcd."""

from __future__ import annotations

import logging

import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.discovery.etcd import FleetMirror
from router.discovery.etcd_client import KeyValue, WatchEvent
from router.fleet.records import Status
from router.fleet.registry import Fleet
from router.observability.metrics import RouterMetrics

P = "/router/workers/"


def value(worker_id: str, port: int, **extra: object) -> bytes:
    return orjson.dumps({"id": worker_id, "url": f"http://10.0.0.1:{port}", "model": "m", **extra})


def put(key: str, data: bytes, revision: int = 10) -> WatchEvent:
    return WatchEvent("PUT", P + key, data, revision)


def delete(key: str, revision: int = 11) -> WatchEvent:
    return WatchEvent("DELETE", P + key, b"", revision)


@pytest.fixture
def setup() -> tuple[Fleet, RouterMetrics, FleetMirror]:
    fleet = Fleet()
    metrics = RouterMetrics(fleet, CollectorRegistry())
    return fleet, metrics, FleetMirror(fleet, metrics.discovery)


def events(metrics: RouterMetrics, kind: str) -> float:
    sample = metrics.registry.get_sample_value("router_discovery_events_total", {"type": kind})
    return sample or 0.0


def test_relist_keeps_valid_records_and_logs_each_malformed_one(
    setup: tuple[Fleet, RouterMetrics, FleetMirror], caplog: pytest.LogCaptureFixture
) -> None:
    fleet, _, mirror = setup
    kvs = [
        KeyValue(P + "a", value("a", 1), 5, 0),
        KeyValue(P + "junk", b"{not json", 6, 0),
        KeyValue(P + "nourl", b'{"id": "x", "model": "m"}', 7, 0),
        KeyValue(P + "b", value("b", 2, status="DRAINING"), 8, 0),
    ]
    with caplog.at_level(logging.WARNING, logger="router.discovery.etcd"):
        mirror.relist(kvs, revision=8)
    assert sorted(w.id for w in fleet.workers()) == ["a", "b"]
    assert fleet.get("b").draining  # type: ignore[union-attr]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert P + "junk" in warned[0] and "not JSON" in warned[0]
    assert P + "nourl" in warned[1] and "'url'" in warned[1]


def test_relist_replaces_the_fleet_but_keeps_live_state_of_survivors(
    setup: tuple[Fleet, RouterMetrics, FleetMirror],
) -> None:
    fleet, _, mirror = setup
    mirror.relist(
        [KeyValue(P + "a", value("a", 1), 5, 0), KeyValue(P + "b", value("b", 2), 6, 0)], 6
    )
    fleet.get("a").begin()  # type: ignore[union-attr]
    mirror.relist(
        [KeyValue(P + "a", value("a", 1), 5, 0), KeyValue(P + "c", value("c", 3), 9, 0)], 9
    )
    assert sorted(w.id for w in fleet.workers()) == ["a", "c"]
    assert fleet.get("a").inflight == 1  # type: ignore[union-attr]
    mirror.apply(delete("c"))  # the mirror learned key c from the relist
    assert [w.id for w in fleet.workers()] == ["a"]


def test_put_then_draining_then_delete(setup: tuple[Fleet, RouterMetrics, FleetMirror]) -> None:
    fleet, metrics, mirror = setup
    mirror.apply(put("a", value("a", 1)))
    worker = fleet.get("a")
    assert worker is not None and not worker.draining
    worker.begin()
    mirror.apply(put("a", value("a", 1, status="DRAINING")))
    assert fleet.get("a") is worker and worker.draining and worker.inflight == 1
    assert worker.record.status is Status.DRAINING
    mirror.apply(delete("a"))
    assert len(fleet) == 0
    mirror.apply(delete("never-seen"))
    assert (events(metrics, "put"), events(metrics, "delete")) == (2, 2)


def test_a_malformed_write_over_a_valid_record_drops_that_worker_like_a_relist(
    setup: tuple[Fleet, RouterMetrics, FleetMirror],
) -> None:
    fleet, _, mirror = setup
    mirror.apply(put("a", value("a", 1)))
    mirror.apply(put("b", value("b", 2)))
    mirror.apply(put("a", b"garbage"))
    assert [w.id for w in fleet.workers()] == ["b"]
    mirror.apply(put("c", b'{"url": 5}'))
    assert [w.id for w in fleet.workers()] == ["b"]


def test_a_key_whose_record_changes_id_moves_the_worker(
    setup: tuple[Fleet, RouterMetrics, FleetMirror],
) -> None:
    fleet, _, mirror = setup
    mirror.apply(put("k", value("old", 1)))
    mirror.apply(put("k", value("new", 1)))
    assert [w.id for w in fleet.workers()] == ["new"]
    mirror.apply(delete("k"))
    assert len(fleet) == 0


def test_two_keys_claiming_one_id_leave_only_with_the_last_key(
    setup: tuple[Fleet, RouterMetrics, FleetMirror], caplog: pytest.LogCaptureFixture
) -> None:
    fleet, _, mirror = setup
    mirror.apply(put("k1", value("w", 1)))
    with caplog.at_level(logging.WARNING, logger="router.discovery.etcd"):
        mirror.apply(put("k2", value("w", 2)))
    assert "claimed by" in caplog.text
    assert fleet.get("w").url == "http://10.0.0.1:2"  # type: ignore[union-attr]
    mirror.apply(delete("k2"))
    assert fleet.get("w").url == "http://10.0.0.1:1"  # type: ignore[union-attr]
    mirror.apply(delete("k1"))
    assert len(fleet) == 0


def test_a_malformed_record_is_logged_once_however_often_it_is_seen_again(
    setup: tuple[Fleet, RouterMetrics, FleetMirror], caplog: pytest.LogCaptureFixture
) -> None:
    fleet, _, mirror = setup
    tls = orjson.dumps({"id": "t", "url": "https://10.0.0.9:1", "model": "m"})
    listing = [KeyValue(P + "a", value("a", 1), 5, 0), KeyValue(P + "tls", tls, 6, 0)]
    with caplog.at_level(logging.WARNING, logger="router.discovery.etcd"):
        mirror.relist(listing, 10)
        mirror.relist(listing, 20)  # after a compaction: the same bad record again
        mirror.apply(put("tls", tls, 21))  # rewritten with the same value
        assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1
        mirror.apply(put("tls", b"{}", 22))  # a different bad value is news
        mirror.apply(delete("tls", 23))
        mirror.apply(put("tls", tls, 24))  # deleted, then back: news again
    messages = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(messages) == 3
    assert "TLS to workers is not supported" in messages[0]
    assert [w.id for w in fleet.workers()] == ["a"]

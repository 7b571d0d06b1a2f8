"""What a worker advertises: its key, etcd endpoint forms, its address, its record."""

from __future__ import annotations

import pytest

from router.agent.advertise import (
    advertised_url,
    etcd_endpoint_url,
    is_loopback,
    loopback_warning,
    worker_record,
)
from router.agent.registration import registration_key
from router.fleet.records import InvalidWorkerRecord, Role, Status


def test_registration_key_treats_the_prefix_as_a_folder() -> None:
    assert registration_key("/router/workers/", "w1") == "/router/workers/w1"
    assert registration_key("/router/workers", "w1") == "/router/workers/w1"


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("etcd://10.0.0.5:2379", "http://10.0.0.5:2379"),
        ("http://etcd.internal:2379/", "http://etcd.internal:2379"),
        ("https://etcd.internal:2379", "https://etcd.internal:2379"),
        ("10.0.0.5:2379", "http://10.0.0.5:2379"),
    ],
)
def test_etcd_endpoint_forms(given: str, url: str) -> None:
    assert etcd_endpoint_url(given) == url


def test_etcd_endpoint_without_host_is_refused() -> None:
    with pytest.raises(ValueError, match="etcd://HOST:PORT"):
        etcd_endpoint_url("ftp://x:1")
    with pytest.raises(ValueError, match="etcd://HOST:PORT"):
        etcd_endpoint_url("etcd://")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("10.0.0.5", False),
        ("0.0.0.0", False),
        ("gpu-node-3", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_loopback_warning_only_when_etcd_is_reachable_from_elsewhere() -> None:
    warning = loopback_warning("127.0.0.1", "http://10.0.0.5:2379")
    assert warning is not None and "--advertise-host" in warning and "10.0.0.5" in warning
    assert loopback_warning("127.0.0.1", "http://127.0.0.1:2379") is None
    assert loopback_warning("10.0.0.7", "http://10.0.0.5:2379") is None
    assert loopback_warning("localhost", "http://[::1]:2379") is None


def test_advertised_url_keeps_scheme_port_and_path() -> None:
    assert advertised_url("http://127.0.0.1:30000", "10.0.0.7") == "http://10.0.0.7:30000"
    assert advertised_url("https://127.0.0.1/", "gpu-3") == "https://gpu-3:443"
    assert advertised_url("http://localhost:8000/engine/", "::1") == "http://[::1]:8000/engine"
    with pytest.raises(ValueError, match="engine URL"):
        advertised_url("127.0.0.1:30000", "10.0.0.7")


def test_worker_record_is_the_registered_json_and_omits_status_while_active() -> None:
    record = worker_record(
        worker_id="p1",
        url="http://10.0.0.7:30000",
        model="m",
        role="prefill",
        engine="sglang",
        dp_size=4,
        bootstrap_port=8998,
        pd_protocol="nixl",
    )
    assert record.role is Role.PREFILL and record.status is Status.ACTIVE
    assert record.rank_multiplexed
    assert record.to_json() == {
        "id": "p1",
        "url": "http://10.0.0.7:30000",
        "model": ["m"],
        "role": "prefill",
        "engine": "sglang",
        "dp_size": 4,
        "dp_rank": None,
        "disagg_meta": {"protocol": "nixl", "params": {"bootstrap_addr": "10.0.0.7:8998"}},
    }
    ipv6 = worker_record(
        worker_id="p2",
        url="http://[fd00::7]:30000",
        model="m",
        role="prefill",
        engine="vllm",
        bootstrap_port=8998,
    )
    assert ipv6.bootstrap_addr == "[fd00::7]:8998"
    lora = worker_record(
        worker_id="w", url="http://w:1", model="m", role="mixed", engine="vllm", adapters=("a",)
    )
    assert lora.to_json()["adapters"] == ["a"]


def test_worker_record_rejects_a_bad_field() -> None:
    with pytest.raises(InvalidWorkerRecord, match="dp_rank"):
        worker_record(
            worker_id="w",
            url="http://h:1",
            model="m",
            role="mixed",
            engine="sglang",
            dp_size=2,
            dp_rank=2,
        )

"""Worker URLs are checked once, where the record is parsed, with the pool's own rules."""

from __future__ import annotations

import pytest

from router.fleet.records import InvalidWorkerRecord, WorkerRecord
from router.http.upstream.worker_url import InvalidWorkerUrl, WorkerAddress, parse_worker_url


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://gpu-3:30000", WorkerAddress("gpu-3", 30000, b"gpu-3:30000", "")),
        ("http://10.0.0.7", WorkerAddress("10.0.0.7", 80, b"10.0.0.7", "")),
        ("http://[::1]:8000/engine/", WorkerAddress("::1", 8000, b"[::1]:8000", "/engine")),
        ("http://node_7.local:1/v", WorkerAddress("node_7.local", 1, b"node_7.local:1", "/v")),
        ("grpc://gpu-3:50051", WorkerAddress("gpu-3", 50051, b"gpu-3:50051", "", "grpc")),
        ("grpc://[::1]:9/", WorkerAddress("::1", 9, b"[::1]:9", "", "grpc")),
    ],
)
def test_good_urls_give_what_the_pool_connects_to_and_writes(
    url: str, address: WorkerAddress
) -> None:
    assert parse_worker_url(url) == address


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://gpu-3:30000", "TLS to workers is not supported"),
        ("grpcs://gpu-3:30000", "TLS to workers is not supported"),
        ("grpc://gpu-3", "must name its port"),
        ("grpc://gpu-3:50051/engine", "a grpc:// URL has no path"),
        ("ftp://gpu-3:21", "must start with http://"),
        ("gpu-3:30000", "must start with http://"),
        ("http://gpü-3:30000", "must be ASCII"),
        ("http://gpu-3:30000/a b", "without spaces or control characters"),
        ("http://gpu-3:30000/a\tb", "without spaces or control characters"),
        ("http://gpu-3:30000/a\x00", "without spaces or control characters"),
        ("http://gpu-3:30000/a\x7f", "without spaces or control characters"),
        ("http://user:secret@gpu-3:30000", "user name or password"),
        ("http://gpu-3:30000/?debug=1", "query or a fragment"),
        ("http://gpu-3:30000/#top", "query or a fragment"),
        ("http://gpu-3:70000", "malformed"),
        ("http://gpu-3:port", "malformed"),
        ("http://gpu-3:0", "port 0"),
        ("http://:8000", "no valid host"),
        ("http://gp%33:8000", "no valid host"),
    ],
)
def test_bad_urls_are_refused_saying_why(url: str, why: str) -> None:
    with pytest.raises(InvalidWorkerUrl, match=why):
        parse_worker_url(url)
    # The record parser (static flags, fleet files, etcd values) applies the same rules.
    with pytest.raises(InvalidWorkerRecord, match=why):
        WorkerRecord.from_json({"url": url, "model": "m"})


def test_a_record_keeps_its_url_without_the_trailing_slash() -> None:
    assert WorkerRecord.from_json({"url": "http://gpu-3:1/", "model": "m"}).url == "http://gpu-3:1"

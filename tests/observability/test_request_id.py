"""Which id a request gets, and what a client cannot smuggle in through it."""

from __future__ import annotations

import os
import re

import pytest

from router.http.server.messages import Request
from router.observability.request_id import (
    MAX_ID_BYTES,
    choose_request_id,
    current_request_id,
    forget,
    identify,
)

TRACE = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _request(*headers: tuple[bytes, bytes]) -> Request:
    return Request("POST", "/v1/chat/completions", list(headers))


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (
            [
                (b"x-request-id", b"req-1"),
                (b"x-correlation-id", b"corr-1"),
                (b"traceparent", TRACE),
            ],
            b"req-1",
        ),
        ([(b"x-correlation-id", b"corr-1"), (b"traceparent", TRACE)], b"corr-1"),
        ([(b"traceparent", TRACE)], b"4bf92f3577b34da6a3ce929d0e0e4736"),
        ([(b"x-request-id", b"first"), (b"x-request-id", b"second")], b"first"),
        # Unusable values fall through to the next source.
        ([(b"x-request-id", b"has space"), (b"x-correlation-id", b"corr-2")], b"corr-2"),
        (
            [(b"x-request-id", b"a" * (MAX_ID_BYTES + 1)), (b"traceparent", TRACE)],
            b"4bf92f3577b34da6a3ce929d0e0e4736",
        ),
    ],
)
def test_the_first_usable_client_id_wins(
    headers: list[tuple[bytes, bytes]], expected: bytes
) -> None:
    assert choose_request_id(_request(*headers)) == expected


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-request-id", b"")],
        [(b"x-request-id", b"line\x1bbreak")],
        [(b"x-request-id", "caf\u00e9".encode())],
        [(b"traceparent", b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01")],
        [(b"traceparent", b"garbage")],
    ],
)
def test_otherwise_a_fresh_random_id(headers: list[tuple[bytes, bytes]]) -> None:
    first = choose_request_id(_request(*headers))
    second = choose_request_id(_request(*headers))
    assert re.fullmatch(rb"[0-9a-f]{32}", first)
    assert first != second


def test_identify_sets_one_header_and_the_log_context() -> None:
    request = _request((b"x-correlation-id", b"corr-9"), (b"x-request-id", b"bad id"))
    assert current_request_id() == "-"
    request_id, token = identify(request)
    try:
        assert request_id == b"corr-9"
        assert [value for name, value in request.headers if name == b"x-request-id"] == [b"corr-9"]
        assert current_request_id() == "corr-9"
    finally:
        forget(token)
    assert current_request_id() == "-"


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without running the test session's exit
        os.write(write_end, choose_request_id(_request()))
        os._exit(0)
    os.close(write_end)
    parent_id = choose_request_id(_request())
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        child_id = pipe.read()
    assert len(child_id) == len(parent_id) == 32
    assert child_id != parent_id

"""The gRPC status of a scripted failure: the fake's HTTP status as an engine servicer says it.

A case scripts a failure as an HTTP status (`fail_status`) whatever the fleet speaks,
so the same case runs on HTTP and gRPC workers. Over gRPC the fake ends the call with
the status vLLM's servicer (`smg-grpc-servicer` 0.14.1) gives the same engine condition:
a refused request is INVALID_ARGUMENT, an unknown one NOT_FOUND, a full queue
RESOURCE_EXHAUSTED, an engine that cannot take work UNAVAILABLE, a timeout
DEADLINE_EXCEEDED, and any other status (500 among them) INTERNAL.
"""

from __future__ import annotations

import grpc

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def code_for_status(status: int) -> grpc.StatusCode:
    """The gRPC code the servicer answers for an engine's HTTP `status`."""
    return _CODES.get(status, grpc.StatusCode.INTERNAL)

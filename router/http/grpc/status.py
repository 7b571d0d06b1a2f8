"""gRPC status codes and the client's exceptions: what a call to an engine can end with.

The codes are gRPC's own numbers (`grpc/status.h`); the client reads them from the
`grpc-status` trailer (or a trailers-only answer) and never needs grpcio to name them.
"""

from __future__ import annotations

import enum
from urllib.parse import unquote

__all__ = [
    "GrpcBroken",
    "GrpcConnectError",
    "GrpcError",
    "GrpcProtocolError",
    "GrpcStatusError",
    "StatusCode",
    "status_from_http",
]


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def read(cls, raw: bytes | None) -> StatusCode:
        """The code of a `grpc-status` value; UNKNOWN for a missing or foreign one, as
        gRPC's own clients read it."""
        try:
            return cls(int(raw)) if raw is not None else cls.UNKNOWN
        except ValueError:
            return cls.UNKNOWN


# gRPC's mapping of an HTTP status seen where a gRPC answer was expected (a proxy's, or a
# server that is not gRPC): doc/http-grpc-status-mapping.md.
_FROM_HTTP = {
    400: StatusCode.INTERNAL,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.UNIMPLEMENTED,
    429: StatusCode.UNAVAILABLE,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.UNAVAILABLE,
}


def status_from_http(status: int) -> StatusCode:
    return _FROM_HTTP.get(status, StatusCode.UNKNOWN)


class GrpcError(Exception):
    """Anything that ended a gRPC call other than its OK status."""


class GrpcConnectError(GrpcError):
    """No connection to the worker (refused, unreachable, timed out): nothing was sent."""


class GrpcBroken(GrpcError):
    """The connection broke (or the worker went away) while the call was open.

    `unprocessed`: the worker said it never began the call (a GOAWAY naming a lower last
    stream, or a REFUSED_STREAM reset), so sending it elsewhere sends it once.
    """

    def __init__(self, message: str, *, unprocessed: bool = False) -> None:
        super().__init__(message)
        self.unprocessed = unprocessed


class GrpcProtocolError(GrpcError):
    """The worker broke gRPC's framing: a compressed message (none was offered), a
    message beyond the size bound, or HTTP/2 the client cannot follow."""


class GrpcStatusError(GrpcError):
    """The call ended with a status other than OK; `message` is the worker's own
    (`grpc-message`, percent-decoded)."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message

    @classmethod
    def from_trailers(cls, status: bytes | None, message: bytes | None) -> GrpcStatusError:
        text = unquote(message.decode("utf-8", "replace")) if message else ""
        return cls(StatusCode.read(status), text)

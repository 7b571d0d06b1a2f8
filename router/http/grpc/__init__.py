"""The gRPC upstream: calls to engines' gRPC services over one HTTP/2 connection per
worker (`h2` on trio), messages as bytes; the callers encode the published protobufs."""

from router.http.grpc.connection import GrpcCall
from router.http.grpc.pool import GrpcPool, GrpcPoolSettings, GrpcPoolStatistics, open_grpc_pool
from router.http.grpc.status import (
    GrpcBroken,
    GrpcConnectError,
    GrpcError,
    GrpcProtocolError,
    GrpcStatusError,
    StatusCode,
)

__all__ = [
    "GrpcBroken",
    "GrpcCall",
    "GrpcConnectError",
    "GrpcError",
    "GrpcPool",
    "GrpcPoolSettings",
    "GrpcPoolStatistics",
    "GrpcProtocolError",
    "GrpcStatusError",
    "StatusCode",
    "open_grpc_pool",
]

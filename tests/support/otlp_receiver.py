"""A small OTLP/HTTP trace receiver for tests: it decodes what the router exports.

It serves `POST /v1/traces` on 127.0.0.1:0 with the project's own HTTP server and parses
each body as an `ExportTraceServiceRequest` (protobuf, via `opentelemetry-proto`), so a
test reads the spans as a collector would get them, ids and attributes included.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from router.http.server.loop import serve_http
from router.http.server.messages import Request, ResponseWriter

PROTOBUF = b"application/x-protobuf"


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    status_code: int
    service: str


@dataclass
class OtlpReceiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    posts: int = 0

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.name == name]

    def children_of(self, parent: ReceivedSpan) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.parent_span_id == parent.span_id]

    async def handle(self, request: Request, writer: ResponseWriter) -> None:
        if request.path != "/v1/traces" or request.method != "POST":
            await writer.respond(404, [], b"")
            return
        body = request.body
        if request.header(b"content-encoding") == b"gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.posts += 1
        for resource_spans in export.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            status_code=span.status.code,
                            service=str(resource.get("service.name", "")),
                        )
                    )
        answer = ExportTraceServiceResponse().SerializeToString()
        await writer.respond(200, [(b"content-type", PROTOBUF)], answer)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@asynccontextmanager
async def open_otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, receiver.handle))
        receiver.url = f"http://127.0.0.1:{port}/v1/traces"
        try:
            yield receiver
        finally:
            nursery.cancel_scope.cancel()

"""Tracing with OpenTelemetry (the optional `otel` extra), and what it costs when off.

With `--otlp-traces-endpoint`, each generation request is one span, and each attempt on a
worker (each PD leg) a child span with the worker, the attempt number per role, the
breaker verdict and the worker's status. The attempt's W3C `traceparent` goes to the
worker in place of the client's, so an engine that traces continues the same trace.
Spans are exported over OTLP/HTTP by the SDK's batch processor, in its own thread: the
request path only records, it never waits on the exporter.

When tracing is off, the request path meets `NO_REQUEST_TRACE` and `NO_ATTEMPT_TRACE`:
do-nothing objects, so the cost is a few method calls per request and no import of
OpenTelemetry at all. `bench/` measures it.
"""

from __future__ import annotations

import contextvars
import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar, Final

import trio

from router.fleet.breaker import Outcome
from router.fleet.registry import Worker
from router.http.server.messages import Headers, Request, ResponseWriter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_HEADERS: Final = (b"traceparent", b"tracestate")
SHUTDOWN_TIMEOUT_S: Final = 5.0


class AttemptTrace:
    """One attempt's span; this base class is the do-nothing one used when tracing is off."""

    __slots__ = ()

    def inject(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The upstream headers with this attempt's `traceparent`."""
        return headers

    def answered(self, status: int) -> None:
        """The worker's response status."""

    def verdict(self, outcome: Outcome) -> None:
        """The breaker verdict of the attempt (recorded as `success`, `fault`, `neutral`).
        Its name is read only while tracing: an enum's `.value` is two Python calls."""

    def end(self) -> None:
        """The attempt is over (answered, failed or cancelled)."""


class RequestTrace:
    """One request's span; this base class is the do-nothing one used when tracing is off."""

    __slots__ = ()

    def attempt(self, worker: Worker) -> AttemptTrace:
        return NO_ATTEMPT_TRACE

    def end(self, status: int | None) -> None:
        """The request is over; `status` is what the client got (None: nothing was sent)."""


NO_ATTEMPT_TRACE: Final = AttemptTrace()
NO_REQUEST_TRACE: Final = RequestTrace()
_current: Final[contextvars.ContextVar[RequestTrace]] = contextvars.ContextVar(
    "router_trace", default=NO_REQUEST_TRACE
)


def current_trace() -> RequestTrace:
    """The trace of the request this task serves (the do-nothing one outside a request)."""
    return _current.get()


class StatusWriter:
    """A response writer that remembers the status it sent (only used while tracing)."""

    __slots__ = ("_writer", "status")

    def __init__(self, writer: ResponseWriter) -> None:
        self._writer = writer
        self.status: int | None = None

    @property
    def started(self) -> bool:
        return self._writer.started

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.status = status
        await self._writer.respond(status, headers, body)

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        self.status = status
        await self._writer.start(status, headers, first)

    async def write(self, data: bytes) -> None:
        await self._writer.write(data)

    async def finish(self, last: bytes = b"") -> None:
        await self._writer.finish(last)

    async def abort(self, *, reset: bool = False) -> None:
        await self._writer.abort(reset=reset)


class Tracing:
    """Where requests get their trace. Off unless built with an OTLP endpoint.

    An async context manager: on exit, `aclose` (`open_tracing`)."""

    enabled: ClassVar[bool] = False

    def begin(
        self, request: Request, writer: ResponseWriter
    ) -> tuple[RequestTrace, ResponseWriter]:
        return NO_REQUEST_TRACE, writer

    def enter(self, trace: RequestTrace) -> contextvars.Token[RequestTrace] | None:
        return None

    def leave(self, token: contextvars.Token[RequestTrace] | None) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> Tracing:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class OtlpTracing(Tracing):
    """OpenTelemetry spans exported over OTLP/HTTP to `endpoint` (e.g. `http://collector:4318/v1/traces`)."""

    enabled: ClassVar[bool] = True

    def __init__(self, endpoint: str, service_name: str = "trio-router") -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.in_context = trace.set_span_in_context
        self.server_kind, self.client_kind = trace.SpanKind.SERVER, trace.SpanKind.CLIENT
        self.error = trace.StatusCode.ERROR
        # A provider of our own, not the global one: several routers in one process (tests,
        # embedding) each export where they were told.
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name})
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer: Tracer = self.provider.get_tracer("router")
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()

    def begin(
        self, request: Request, writer: ResponseWriter
    ) -> tuple[RequestTrace, ResponseWriter]:
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in request.headers
            if name in TRACE_HEADERS
        }
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            f"{request.method} {request.path}",
            context=parent,
            kind=self.server_kind,
            attributes={
                "http.request.method": request.method,
                "url.path": request.path,
                "router.request_id": (request.header(b"x-request-id") or b"").decode("latin-1"),
            },
        )
        recorder = StatusWriter(writer)
        return _OtelRequestTrace(self, span, recorder), recorder

    def enter(self, trace: RequestTrace) -> contextvars.Token[RequestTrace] | None:
        return _current.set(trace)

    def leave(self, token: contextvars.Token[RequestTrace] | None) -> None:
        if token is not None:
            _current.reset(token)

    async def flush(self) -> None:
        """Export every ended span now (the exporter's thread does the network call)."""
        await trio.to_thread.run_sync(self.provider.force_flush)

    async def aclose(self) -> None:
        """Flush and stop the exporter, at most `SHUTDOWN_TIMEOUT_S`, even when cancelled."""
        with trio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)


class _OtelRequestTrace(RequestTrace):
    __slots__ = ("_attempts", "_recorder", "_span", "_tracing")

    def __init__(self, tracing: OtlpTracing, span: Span, recorder: StatusWriter) -> None:
        self._tracing = tracing
        self._span = span
        self._recorder = recorder
        self._attempts: dict[str, int] = {}

    def attempt(self, worker: Worker) -> AttemptTrace:
        tracing = self._tracing
        role = worker.role.value
        number = self._attempts[role] = self._attempts.get(role, 0) + 1
        span = tracing.tracer.start_span(
            f"{role} attempt",
            context=tracing.in_context(self._span),
            kind=tracing.client_kind,
            attributes={
                "router.worker": worker.id,
                "router.role": role,
                "router.attempt": number,
                "server.address": worker.url,
            },
        )
        return _OtelAttemptTrace(tracing, span)

    def end(self, status: int | None) -> None:
        status = status if status is not None else self._recorder.status
        if status is not None:
            self._span.set_attribute("http.response.status_code", status)
            if status >= 500:
                self._span.set_status(self._tracing.error)
        self._span.end()


class _OtelAttemptTrace(AttemptTrace):
    __slots__ = ("_span", "_tracing")

    def __init__(self, tracing: OtlpTracing, span: Span) -> None:
        self._tracing = tracing
        self._span = span

    def inject(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        carrier: dict[str, Any] = {}
        self._tracing.propagator.inject(carrier, context=self._tracing.in_context(self._span))
        kept = [item for item in headers if item[0] not in TRACE_HEADERS]
        return kept + [(name.encode(), str(value).encode()) for name, value in carrier.items()]

    def answered(self, status: int) -> None:
        self._span.set_attribute("http.response.status_code", status)

    def verdict(self, outcome: Outcome) -> None:
        self._span.set_attribute("router.verdict", outcome.value)

    def end(self) -> None:
        self._span.end()


def otel_installed() -> bool:
    """Whether the `otel` extra is installed."""
    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except ModuleNotFoundError:
        return False


def open_tracing(endpoint: str) -> Tracing:
    """Tracing to `endpoint`, or the do-nothing kind when it is empty, to enter with `async
    with`; on exit, the spans still buffered are exported (at most `SHUTDOWN_TIMEOUT_S`).
    (A class's `__aexit__`, not an `asynccontextmanager`: the compiled build has no async
    generators.)"""
    return OtlpTracing(endpoint) if endpoint else Tracing()

"""What the router tells about itself: Prometheus metrics, OpenTelemetry tracing, request ids,
and how every command logs."""

from router.observability.logs import configure_logging
from router.observability.metrics import (
    CONTENT_TYPE,
    BreakerMetrics,
    DiscoveryMetrics,
    PipelineMetrics,
    RequestMetrics,
    RouterMetrics,
)
from router.observability.request_id import IdentifiedWriter, current_request_id, forget, identify
from router.observability.runtime_metrics import TaskCollector
from router.observability.tracing import (
    NO_ATTEMPT_TRACE,
    AttemptTrace,
    Tracing,
    current_trace,
    open_tracing,
    otel_installed,
)

__all__ = [
    "CONTENT_TYPE",
    "NO_ATTEMPT_TRACE",
    "AttemptTrace",
    "BreakerMetrics",
    "DiscoveryMetrics",
    "IdentifiedWriter",
    "PipelineMetrics",
    "RequestMetrics",
    "RouterMetrics",
    "TaskCollector",
    "Tracing",
    "configure_logging",
    "current_request_id",
    "current_trace",
    "forget",
    "identify",
    "open_tracing",
    "otel_installed",
]

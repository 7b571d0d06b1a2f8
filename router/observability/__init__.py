"""What the router tells about itself: Prometheus metrics, OpenTelemetry tracing, request ids."""

"""Prometheus metrics of one router instance (a fresh registry each, so tests never share).

The families the router counts come in groups, one per concern, and each layer is handed
only the group it counts in: `RequestMetrics` (what the client got, and when),
`PipelineMetrics` (how the request pipeline got there, aliases and fallbacks included),
`AdmissionMetrics` (how long
admitted requests waited, by class and tenant), `BreakerMetrics` (trips per
worker), `DiscoveryMetrics` (the discovery source). `RouterMetrics` builds the groups on
one registry and exports them, with the figures read from the fleet and the upstream pool
at scrape time (`router.observability.collectors`): the request path never touches those.

The families every request counts in (requests answered, their durations and times to
the first byte, the dispatch mode) are tallies: plain numbers exported at scrape time
(`router.observability.tallies`), with no lock per increment. The rarer series are
prometheus-client's, their label children bound once per label value the first time it
is used (a series appears with its first event), never a `labels()` call per event. A
departed worker's children are dropped with it.
"""

from __future__ import annotations

from typing import Final, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from router.fleet.records import Mode, Role
from router.fleet.registry import Fleet
from router.http.grpc import GrpcPool
from router.http.upstream.pool import UpstreamPool
from router.observability.collectors import FleetCollector, GrpcPoolCollector, PoolCollector
from router.observability.tallies import CounterTally, HistogramTally

_Family = TypeVar("_Family", bound=MetricWrapperBase)

CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


def _bound(children: dict[str, _Family], family: _Family, value: str) -> _Family:
    """The child of `family` for one label value, bound the first time it is asked for."""
    child = children.get(value)
    if child is None:
        child = children[value] = family.labels(value)
    return child


class RequestMetrics:
    """What the client got: requests answered by model, route and status (and client key),
    the time to the end of the answer and to its first byte, by route. Counted by the
    pipeline for what it serves and by the edge for what it refuses first; tallies, as
    every request counts in them (`router.observability.tallies`)."""

    def __init__(self, *, key_label: bool = False) -> None:
        # The `key` label exists only with named client keys; its values are those names.
        self.key_label = key_label
        labels = ["model", "route", "status", "key"] if key_label else ["model", "route", "status"]

        def labels_of(key: tuple[str, str, int, str]) -> tuple[str, ...]:
            model, route, status, name = key
            return (model, route, str(status), name) if key_label else (model, route, str(status))

        self.answered: CounterTally[tuple[str, str, int, str]] = CounterTally(
            "router_requests", "Requests answered", labels, labels_of
        )
        self.duration = HistogramTally(
            "router_request_duration_seconds",
            "Time from request to the end of the answer",
            "route",
            _LATENCY_BUCKETS,
        )
        self.ttfb = HistogramTally(
            "router_time_to_first_byte_seconds",
            "Time from request to the first answer byte sent",
            "route",
            _LATENCY_BUCKETS,
        )

    def count_request(self, model: str, route: str, status: int, key: str | None = None) -> None:
        """Count one answered request; `key` is the client key's name (`-`: none), used only
        when the counter has the `key` label."""
        self.answered.inc((model, route, status, key or "-"))

    def observe_duration(self, route: str, seconds: float) -> None:
        self.duration.observe(route, seconds)

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self.ttfb.observe(route, seconds)


class PipelineMetrics:
    """How the request pipeline served: generation requests by dispatch mode, retries on
    another worker by reason, PD legs failed before the first byte by role, requests
    refused for the router's own shortage by kind, and streams broken after the first
    byte by what became of them."""

    def __init__(self) -> None:
        self.retries = Counter(
            "router_retries",
            "Attempts retried on another worker, by reason",
            ["reason"],
            registry=None,
        )
        # Every generation request counts here: a tally.
        self.modes: CounterTally[tuple[str]] = CounterTally(
            "router_pd_requests", "Generation requests by dispatch mode", ["mode"]
        )
        self.leg_failures = Counter(
            "router_leg_failures", "Pre-first-byte failures by leg role", ["role"], registry=None
        )
        self.local_errors = Counter(
            "router_local_errors",
            "Requests refused for the router's own shortage (no worker blamed), by kind",
            ["kind"],
            registry=None,
        )
        self.resumes = Counter(
            "router_resumes",
            "Streams broken after the first byte, by route and what became of them",
            ["route", "outcome"],
            registry=None,
        )
        self.resume_refusals = Counter(
            "router_resume_refusals",
            "Broken streams not resumed, by route and why",
            ["route", "reason"],
            registry=None,
        )
        self.rewrites = Counter(
            "router_model_rewrites",
            "Requests for an alias, by alias and the served model drawn for them",
            ["alias", "model"],
            registry=None,
        )
        self.fallbacks = Counter(
            "router_model_fallbacks",
            "Requests planned for a fallback because their model had no worker that could "
            "take them, by model and fallback",
            ["model", "fallback"],
            registry=None,
        )
        self._rewrites: dict[tuple[str, str], Counter] = {}
        self._fallbacks: dict[tuple[str, str], Counter] = {}
        self._retries: dict[str, Counter] = {}
        self._leg_failures: dict[str, Counter] = {}
        self._local_errors: dict[str, Counter] = {}

    def count_retry(self, reason: str) -> None:
        _bound(self._retries, self.retries, reason).inc()

    def count_mode(self, mode: Mode) -> None:
        """Count a generation request under the mode it was first planned in."""
        # `str(mode)`: its value (a StrEnum), without the two Python calls of `.value`.
        self.modes.inc((str(mode),))

    def count_leg_failure(self, role: Role) -> None:
        _bound(self._leg_failures, self.leg_failures, role.value).inc()

    def count_local_error(self, kind: str) -> None:
        _bound(self._local_errors, self.local_errors, kind).inc()

    def count_resume(self, route: str, outcome: str) -> None:
        """A stream of `route` broke after its first byte: `outcome` is what became of it
        (`router.pipeline.resume.Outcome`). Rare: bound on use."""
        self.resumes.labels(route, outcome).inc()

    def count_resume_refusal(self, route: str, reason: str) -> None:
        self.resume_refusals.labels(route, reason).inc()

    def count_rewrite(self, alias: str, model: str) -> None:
        """Count a request for `alias` planned for `model` (both names from the settings)."""
        child = self._rewrites.get((alias, model))
        if child is None:
            child = self._rewrites[(alias, model)] = self.rewrites.labels(alias, model)
        child.inc()

    def count_fallback(self, model: str, fallback: str) -> None:
        """Count a request of `model` planned for `fallback` (both from the settings)."""
        child = self._fallbacks.get((model, fallback))
        if child is None:
            child = self._fallbacks[(model, fallback)] = self.fallbacks.labels(model, fallback)
        child.inc()


class AdmissionMetrics:
    """How long admitted requests waited for their slot, by priority class, and by tenant
    when `by_tenant` (opt-in). Class names come from the settings; tenant values are key
    names from the keys file (`-` without a key), never a header's value, so neither label
    can grow with what clients send. Observed for every admitted request, 0 for one
    admitted at once."""

    def __init__(self, *, by_tenant: bool = False) -> None:
        self.by_tenant = by_tenant
        self.wait = Histogram(
            "router_admission_wait_seconds",
            "Time an admitted request waited for its admission slot, by priority class",
            ["class"],
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.tenant_wait = Histogram(
            "router_admission_tenant_wait_seconds",
            "Time an admitted request waited for its admission slot, by client key name "
            "(with --admission-metrics-by-tenant)",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self._wait: dict[str, Histogram] = {}
        self._tenant_wait: dict[str, Histogram] = {}

    def observe_wait(self, priority_class: str, key: str, seconds: float) -> None:
        _bound(self._wait, self.wait, priority_class).observe(seconds)
        if self.by_tenant:
            _bound(self._tenant_wait, self.tenant_wait, key).observe(seconds)


class BreakerMetrics:
    """Breaker trips per worker, counted only while the worker is in the fleet: a departed
    worker's series is dropped and never comes back."""

    def __init__(self) -> None:
        self.trips = Counter(
            "router_worker_breaker_trips",
            "Breaker trips: closed to open (a failed probe re-opens without a new trip)",
            ["worker"],
            registry=None,
        )
        self._trips: dict[str, Counter] = {}
        self._fleet: Fleet | None = None

    def follow(self, fleet: Fleet) -> None:
        """From now on, count trips only for workers in `fleet`."""
        self._fleet = fleet

    def count_trip(self, worker_id: str) -> None:
        """Count a breaker trip of `worker_id`, unless the worker already left the fleet (its
        last request failing after it left): a departed worker gets no series back."""
        if self._fleet is not None and self._fleet.get(worker_id) is None:
            return
        _bound(self._trips, self.trips, worker_id).inc()

    def forget_worker(self, worker_id: str) -> None:
        """Drop the labelled series of a worker that left the fleet (the fleet-shaped
        gauges are read from the fleet at scrape time and need nothing)."""
        if self._trips.pop(worker_id, None) is not None:
            self.trips.remove(worker_id)


class DiscoveryMetrics:
    """Whether the discovery source answers, the events applied by type, and the full
    relists of the source."""

    def __init__(self) -> None:
        self.up = Gauge(
            "router_discovery_up",
            "1 while the discovery source answers, 0 while it does not",
            registry=None,
        )
        self.events = Counter(
            "router_discovery_events", "Discovery events applied, by type", ["type"], registry=None
        )
        self.relists = Counter(
            "router_discovery_relists", "Full relists of the discovery source", registry=None
        )
        self.up.set(1)
        self._events: dict[str, Counter] = {}

    def report_up(self, up: bool) -> None:
        """Say whether the discovery source answers (1) or not (0)."""
        self.up.set(1 if up else 0)

    def count_event(self, kind: str) -> None:
        """Count one applied event of type `kind` (put, delete, added, bookmark, ...)."""
        _bound(self._events, self.events, kind).inc()

    def count_relist(self) -> None:
        self.relists.inc()


class RouterMetrics:
    """One router's metrics: the groups each layer counts in (`requests`, `pipeline`,
    `admission`, `breakers`, `discovery`) on one registry, and what is read at scrape time."""

    def __init__(
        self,
        fleet: Fleet | None = None,
        registry: CollectorRegistry | None = None,
        *,
        key_label: bool = False,
        tenant_label: bool = False,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = RequestMetrics(key_label=key_label)
        self.admission = AdmissionMetrics(by_tenant=tenant_label)
        self.pipeline = PipelineMetrics()
        self.breakers = BreakerMetrics()
        self.discovery = DiscoveryMetrics()
        # Each group builds its families unregistered; they are registered here, in the
        # order `/metrics` lists them in.
        for family in (
            self.requests.answered,
            self.requests.duration,
            self.requests.ttfb,
            self.pipeline.retries,
            self.breakers.trips,
            self.pipeline.modes,
            self.pipeline.leg_failures,
            self.discovery.up,
            self.discovery.events,
            self.discovery.relists,
            self.pipeline.local_errors,
            self.pipeline.resumes,
            self.pipeline.resume_refusals,
            self.admission.wait,
            self.admission.tenant_wait,
            self.pipeline.rewrites,
            self.pipeline.fallbacks,
        ):
            self.registry.register(family)
        if fleet is not None:
            self.watch_fleet(fleet)

    def watch_fleet(self, fleet: Fleet) -> None:
        """Export the fleet's gauges (read at scrape time); breaker trips are counted only
        for workers still in it."""
        self.breakers.follow(fleet)
        self.registry.register(FleetCollector(fleet))

    def watch_pool(self, pool: UpstreamPool) -> None:
        """Export the upstream pool's connections, waiting checkouts and stale discards."""
        self.registry.register(PoolCollector(pool))

    def watch_grpc_pool(self, pool: GrpcPool) -> None:
        """Export the gRPC pool's connections and calls."""
        self.registry.register(GrpcPoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)

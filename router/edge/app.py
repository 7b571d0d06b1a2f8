"""Routes: which handler answers which method and path. Nothing else lives here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import orjson
import trio

from router.api.error_shapes import error_body
from router.api.errors import JSON_CONTENT_TYPE, MethodNotAllowed, NotFound, RouterError
from router.api.routes import ROUTES, Dialect
from router.discovery import DiscoveryHealth
from router.edge.admin import AdminApi, is_admin_route
from router.edge.admission import AdmissionGate, AdmissionSettings
from router.edge.auth import ClientKeys
from router.fleet.records import WorkerRecord
from router.fleet.registry import Worker
from router.http.server.messages import Request, ResponseWriter
from router.observability.metrics import CONTENT_TYPE, RequestMetrics
from router.observability.request_id import IdentifiedWriter, forget, identify
from router.observability.tracing import Tracing
from router.pipeline.service import GenerationService

_POST: Final = b"POST"
_GET: Final = b"GET, HEAD"


class RouterApp:
    """Paths to handlers. `request_metrics` counts what the app refuses before the pipeline
    sees it; `render_metrics` gives the whole `/metrics` page."""

    def __init__(
        self,
        generation: GenerationService,
        request_metrics: RequestMetrics,
        render_metrics: Callable[[], bytes],
        discovery: DiscoveryHealth,
        *,
        protect_metrics: bool = False,
        keys: ClientKeys | None = None,
        admission: AdmissionGate | None = None,
        admin: AdminApi | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.admin = admin
        self.tracing = tracing if tracing is not None else Tracing()
        self.keys = keys if keys is not None else ClientKeys()
        self.admission = (
            admission if admission is not None else AdmissionGate(AdmissionSettings(0, 0, 1.0))
        )
        # Routes open to anyone even when client keys are checked (probes and scrapers).
        self._open_routes = {"/health", "/readiness"} | (set() if protect_metrics else {"/metrics"})
        self.fleet = generation.fleet
        self.request_metrics = request_metrics
        self._render_metrics = render_metrics
        self.discovery = discovery
        self.generation = generation
        self._get_routes = {
            "/v1/models": self._models,
            "/health": self._health,
            "/readiness": self._readiness,
            "/metrics": self._metrics,
            "/v1/workers": self._workers,
        }

    async def handle(self, request: Request, writer: ResponseWriter) -> None:
        """Give the request its id, then route it; the id is on the answer whatever it is."""
        request_id, token = identify(request)
        try:
            await self._route(request, IdentifiedWriter(writer, request_id))
        finally:
            forget(token)

    async def _route(self, request: Request, writer: ResponseWriter) -> None:
        path = request.path
        model_route = ROUTES.get(path)
        try:
            if model_route is not None:
                if request.method != "POST":
                    raise MethodNotAllowed(f"{path} accepts POST, not {request.method}", _POST)
                trace, writer = self.tracing.begin(request, writer)
                token = self.tracing.enter(trace)
                try:
                    key = self._authorize_generation(request, path)
                    await self._admit_generation(request, writer, path, key)
                except RouterError as error:
                    await writer.respond(
                        error.status,
                        [JSON_CONTENT_TYPE, *error.headers()],
                        error_body(error, model_route.dialect),
                    )
                finally:
                    self.tracing.leave(token)
                    trace.end(None)
                return
            if is_admin_route(request):
                if self.admin is None:
                    raise NotFound(f"no route {path}")  # no admin key: the routes do not exist
                status, body = await self.admin.handle(request)
                await writer.respond(status, [JSON_CONTENT_TYPE], body)
                return
            route = self._get_routes.get(path)
            if route is None:
                raise NotFound(f"no route {path}")
            if self.keys.enabled and path not in self._open_routes:
                self.keys.check(request.header(b"authorization"))
            if request.method not in ("GET", "HEAD"):
                raise MethodNotAllowed(f"{path} accepts GET, not {request.method}", _GET)
            status, content_type, body = route()
            await writer.respond(status, [(b"content-type", content_type)], body)
        except RouterError as error:
            dialect = Dialect.OPENAI if model_route is None else model_route.dialect
            await writer.respond(
                error.status, [JSON_CONTENT_TYPE, *error.headers()], error_body(error, dialect)
            )

    def _authorize_generation(self, request: Request, path: str) -> str | None:
        """The name of the client's key (None when keys are off); 401 before anything else.
        Metrics name it only with named keys (`ClientKeys.named`).

        With keys on, the client's own `Authorization` goes no further than here: workers
        get the router's worker key instead (see `router.pipeline.dispatch.upstream_headers`).
        """
        if not self.keys.enabled:
            return None
        try:
            name = self.keys.check(request.header(b"authorization"))
        except RouterError as error:
            self._count_refusal(path, error.status)
            raise
        request.headers = [item for item in request.headers if item[0] != b"authorization"]
        return name

    async def _admit_generation(
        self, request: Request, writer: ResponseWriter, path: str, key: str | None
    ) -> None:
        """Read what the request claims (its class and tenant, as its key allows), then
        serve it through the admission gate when there is a limit or a tenant cap."""
        keys = self.keys
        label = key if keys.named else None
        gated = self.admission.enabled or keys.caps_in_force
        if not gated and not keys.classes_in_force:
            # Nothing to claim and nothing to wait for: no context manager on the hot path.
            await self.generation.handle(request, writer, label)
            return
        grants = keys.anonymous if key is None else keys.grants(key)
        try:
            claims = grants.claims(request)
            # The class goes on to engines that schedule by it (the service decides).
            priority = claims.rank if keys.classes_in_force else None
            if not gated:
                await self.generation.handle(request, writer, label, priority)
                return
            async with self.admission.admit(claims):
                await self.generation.handle(request, writer, label, priority)
        except RouterError as error:
            # Raised by the claims or the gate before the request was served: the service
            # counted nothing.
            self._count_refusal(path, error.status, label)
            raise

    def _count_refusal(self, path: str, status: int, key: str | None = None) -> None:
        self.request_metrics.count_request("-", ROUTES[path].label, status, key)

    def _models(self) -> tuple[int, bytes, bytes]:
        """The public names: every alias (`--model-alias`), then every served model, then
        every LoRA adapter a worker holds, with `parent` naming its base model (as vLLM
        lists them)."""
        aliases = self.generation.names.aliases
        served = [model for model in self.fleet.models() if model not in aliases]
        data: list[dict[str, Any]] = [
            {"id": model, "object": "model", "owned_by": "router"} for model in (*aliases, *served)
        ]
        data += [
            {"id": adapter, "object": "model", "owned_by": "router", "parent": parent}
            for adapter, parent in self.fleet.adapters().items()
            if adapter not in aliases and adapter not in served
        ]
        return 200, b"application/json", orjson.dumps({"object": "list", "data": data})

    def _takes_work(self, worker: Worker, now: float) -> bool:
        breaker = worker.breaker
        return (
            worker.healthy and not worker.draining and (breaker is None or breaker.available(now))
        )

    def _health(self) -> tuple[int, bytes, bytes]:
        now = trio.current_time()
        workers = self.fleet.workers()
        summary = {
            "status": "ok",
            "workers": len(workers),
            "available": sum(1 for worker in workers if self._takes_work(worker, now)),
            "draining": sum(1 for worker in workers if worker.draining),
            "unhealthy": sum(1 for worker in workers if not worker.healthy),
            "models": self.fleet.models(),
            "discovery": {
                "source": self.discovery.source,
                "up": self.discovery.up,
                "detail": self.discovery.detail,
            },
        }
        return 200, b"application/json", orjson.dumps(summary)

    def _readiness(self) -> tuple[int, bytes, bytes]:
        now = trio.current_time()
        ready = any(self._takes_work(worker, now) for worker in self.fleet.workers())
        body = orjson.dumps({"ready": ready})
        return (200 if ready else 503), b"application/json", body

    def _metrics(self) -> tuple[int, bytes, bytes]:
        return 200, CONTENT_TYPE, self._render_metrics()

    def _workers(self) -> tuple[int, bytes, bytes]:
        now = trio.current_time()
        listing = []
        for worker in self.fleet.workers():
            entry = worker.record.to_json()
            entry.update(_engine_facts(worker.record))
            entry.update(
                status=worker.record.status.value,
                healthy=worker.healthy,
                inflight=worker.inflight,
                rank_inflight=worker.rank_inflight if worker.record.rank_multiplexed else None,
                load=worker.load,
                engine_load=_engine_load(worker, now),
                adapters=worker.adapters.held,
                adapter_slots=_adapter_slots(worker),
            )
            if worker.breaker is not None:
                stats = worker.breaker.statistics(now)
                entry["breaker"] = {
                    "state": stats.state.name.lower(),
                    "consecutive_faults": stats.consecutive_faults,
                    "cooldown_s": stats.cooldown_s,
                    "next_probe_in_s": None
                    if stats.next_probe_at is None
                    else max(0.0, stats.next_probe_at - now),
                    "trips": stats.trips,
                }
            else:
                entry["breaker"] = None
            listing.append(entry)
        for pending in self.fleet.pending.values():
            # Named by discovery, not admitted: its engine has not stated what it needs.
            entry = pending.record.to_json()
            entry.update(_engine_facts(pending.record))
            entry.update(status="PENDING", admitted=False, reason=pending.reason)
            listing.append(entry)
        return 200, b"application/json", orjson.dumps({"workers": listing})


def _engine_load(worker: Worker, now: float) -> dict[str, Any] | None:
    """The engine's own load beyond this process, for `/v1/workers`: None (null) when it
    is not read; `requests` and `age_s` null while unknown."""
    if not worker.shares:
        return None
    share = worker.engine_share()
    return {
        "requests": None if share is None else share[0],
        "age_s": None if share is None else round(max(0.0, now - share[1]), 3),
    }


def _adapter_slots(worker: Worker) -> dict[str, Any] | None:
    """The engine's adapter slots as last read (`vllm:lora_requests_info`), for
    `/v1/workers`; None (null) while unknown or not read."""
    activity = worker.adapters.activity
    if activity is None:
        return None
    return {
        "max_loras": activity.max_loras,
        "running": sorted(activity.running),
        "waiting": sorted(activity.waiting),
    }


def _engine_facts(record: WorkerRecord) -> dict[str, Any]:
    """What the engine stated of itself, for `/v1/workers`: `engine` is None (null) while
    its kind is unknown, `max_model_len` None while no limit is known."""
    return {
        "engine": record.engine,
        "max_model_len": record.max_model_len or None,
        "kv_event_sources": [source.to_json() for source in record.kv_event_sources],
    }

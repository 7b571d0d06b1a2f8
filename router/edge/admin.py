"""The admin API of a static fleet: add a worker, drain one, remove one.

The routes exist only with `--admin-api-key` (without it they are 404, as any unknown
route) and need `Authorization: Bearer <admin key>`. With discovery on, the discovery
source owns the fleet and these routes answer 409: a change made here would be undone,
or worse, fight with it.

A drain marks the worker DRAINING (no new work), waits for the requests it holds to
finish, then removes it. Drains run in the router's nursery, not the caller's: a client
that hangs up on `DELETE` does not leave a worker half-drained.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from urllib.parse import unquote

import httpx
import orjson
import trio

from router.api.errors import BadRequest, Conflict, MethodNotAllowed, NotFound
from router.discovery.static import parse_worker_spec
from router.edge.auth import ClientKeys
from router.engines.models import fetch_models
from router.fleet.records import InvalidWorkerRecord, Status, WorkerRecord
from router.fleet.registry import Fleet, Worker
from router.http.server.messages import Request

log = logging.getLogger("router.admin")

WORKERS_PATH = "/v1/workers"
_DRAIN_POLL_S = 0.05
_DRAIN_SUFFIX = "/drain"


def is_admin_route(request: Request) -> bool:
    """Whether the request is for an admin route (`GET /v1/workers`, the listing, is not)."""
    path = request.path
    if path == WORKERS_PATH:
        return request.method == "POST"
    return path.startswith(WORKERS_PATH + "/")


class AdminApi:
    """Handles `POST /v1/workers`, `POST /v1/workers/{id}/drain`, `DELETE /v1/workers/{id}`."""

    def __init__(
        self,
        fleet: Fleet,
        http: httpx.AsyncClient,
        nursery: trio.Nursery,
        *,
        admin_key: str,
        discovery_owns_fleet: bool,
        drain_timeout_s: float,
        worker_api_key: str = "",
    ) -> None:
        self.worker_api_key = worker_api_key
        self.fleet = fleet
        self.http = http
        self.nursery = nursery
        self.keys = ClientKeys(admin_key)
        self.discovery_owns_fleet = discovery_owns_fleet
        self.drain_timeout_s = drain_timeout_s
        self._drains: dict[str, trio.Event] = {}

    async def handle(self, request: Request) -> tuple[int, bytes]:
        """Status and JSON body of an admin call. Raises RouterError for refusals."""
        self.keys.check(request.header(b"authorization"))
        if self.discovery_owns_fleet:
            raise Conflict("discovery owns the fleet: change it at its source (the etcd records)")
        path = request.path
        if path == WORKERS_PATH:
            return await self._add(request.body)
        # A worker id is often its URL: the id may come percent-encoded, or raw with slashes.
        rest = path[len(WORKERS_PATH) + 1 :]
        if rest.endswith(_DRAIN_SUFFIX):
            if request.method != "POST":
                raise MethodNotAllowed(f"{path} accepts POST, not {request.method}", b"POST")
            worker = self._worker(unquote(rest[: -len(_DRAIN_SUFFIX)]))
            self._start_drain(worker)
            return 202, orjson.dumps(
                {"id": worker.id, "status": Status.DRAINING.value, "inflight": worker.inflight}
            )
        worker_id = unquote(rest)
        if not worker_id:
            raise NotFound(f"no route {path}")
        if request.method != "DELETE":
            raise MethodNotAllowed(f"{path} accepts DELETE, not {request.method}", b"DELETE")
        worker = self._worker(worker_id)
        done = self._start_drain(worker)
        # Shielded by ownership: the drain runs in the router's nursery whatever this
        # caller does; waiting here only tells the caller when it is over.
        await done.wait()
        return 200, orjson.dumps({"id": worker.id, "removed": True})

    async def _add(self, raw: bytes) -> tuple[int, bytes]:
        record = _record_from_body(raw)
        if self.fleet.get(record.id) is not None:
            raise Conflict(f"worker {record.id} is already in the fleet")
        if not record.models:
            try:
                models = await fetch_models(
                    self.http, record.url, api_key=record.api_key or self.worker_api_key or None
                )
            except (httpx.HTTPError, ValueError) as exc:
                raise BadRequest(
                    f"worker {record.url} does not say its model ({exc}): name it in the spec (model=...)"
                ) from None
            record = dataclasses.replace(record, models=models)
        self.fleet.upsert(record)
        log.info("admin: worker %s added for %s", record.id, ", ".join(record.models))
        return 201, orjson.dumps(record.to_json())

    def _worker(self, worker_id: str) -> Worker:
        worker = self.fleet.get(worker_id)
        if worker is None:
            raise NotFound(f"no worker {worker_id!r} in the fleet")
        return worker

    def _start_drain(self, worker: Worker) -> trio.Event:
        """Mark `worker` DRAINING and start removing it once idle; the event says when."""
        done = self._drains.get(worker.id)
        if done is not None:
            return done
        done = self._drains[worker.id] = trio.Event()
        self.fleet.upsert(dataclasses.replace(worker.record, status=Status.DRAINING))
        log.info("admin: draining %s (%d in flight)", worker.id, worker.inflight)
        self.nursery.start_soon(self._drain, worker, done)
        return done

    async def _drain(self, worker: Worker, done: trio.Event) -> None:
        """Wait (polling the router's own count) until the worker holds nothing, then remove.

        Bounded by the drain timeout; past it the worker is removed anyway (requests still
        in flight keep their connection and finish: removal only stops new work).
        """
        with trio.move_on_after(self.drain_timeout_s) as bound:
            while worker.inflight > 0:  # noqa: ASYNC110 - the count has no event; drains are rare
                await trio.sleep(_DRAIN_POLL_S)
        if bound.cancelled_caught:
            log.warning(
                "admin: %s still holds %d requests after %gs; removing it",
                worker.id,
                worker.inflight,
                self.drain_timeout_s,
            )
        if self.fleet.get(worker.id) is worker:
            self.fleet.remove(worker.id)
        log.info("admin: worker %s removed", worker.id)
        del self._drains[worker.id]
        done.set()


def _record_from_body(raw: bytes) -> WorkerRecord:
    """A worker from `{"spec": "URL,role=..."}` (the `--worker` syntax) or a JSON record."""
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest('the body must be a JSON worker record or {"spec": "URL,..."}') from None
    try:
        if isinstance(body, dict) and set(body) == {"spec"} and isinstance(body["spec"], str):
            return parse_worker_spec(body["spec"])
        if isinstance(body, dict) and "status" in body:
            raise BadRequest("'status' is the worker's own to say; add it, then drain it")
        return WorkerRecord.from_json(body)
    except InvalidWorkerRecord as error:
        raise BadRequest(str(error)) from None

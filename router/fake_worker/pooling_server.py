"""The fake engine's handler for its non-generation routes (`pooling.POOLING_ROUTES`).

Each request counts as a dispatch in `/debug/routing`, exactly like a generation request,
and the scripted failures (`--fail-first`, `--fail-mode`) apply to it: a `midstream`
failure sends half of the answer and breaks the connection.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import orjson
import trio

from router.fake_worker.behaviour import Behaviour, FailMode
from router.fake_worker.failures import JSON_HEADERS, break_unary, error_body, serve_failure
from router.fake_worker.formats import BadGenerationRequest
from router.fake_worker.pooling import POOLING_ROUTES, PoolingContext
from router.fake_worker.settings import FakeWorkerSettings
from router.fake_worker.stats import RoutingStats
from router.http.server.messages import ClientDisconnected, Request, ResponseWriter

if TYPE_CHECKING:
    from router.fake_worker.model_tokens import ModelTokens

RANK_HEADER = b"x-data-parallel-rank"
# What a `midstream` failure sends half of when the request itself cannot be answered.
_PLACEHOLDER = orjson.dumps(
    {"object": "list", "data": [{"index": 0, "object": "embedding", "embedding": [0.0] * 8}]}
)


class PoolingService:
    """Serves embeddings, rerank, score, classify, pooling, tokenize and detokenize."""

    def __init__(
        self,
        settings: FakeWorkerSettings,
        behaviour: Behaviour,
        routing: RoutingStats,
        model_tokens: ModelTokens | None = None,
    ) -> None:
        self.settings = settings
        self.behaviour = behaviour
        self.routing = routing
        self.model_tokens = model_tokens
        self._next_id = 0

    async def serve(self, request: Request, writer: ResponseWriter) -> None:
        """Answer one request. Cancellation: counted as a disconnect when the client left."""
        stats = self.routing
        raw_rank = request.header(RANK_HEADER)
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        stats.count_dispatch(
            request.path, None if raw_rank is None else raw_rank.decode("latin-1"), body
        )
        stats.inflight += 1
        try:
            await self._serve(request, writer, body)
        except ClientDisconnected:
            stats.disconnects += 1
        except trio.Cancelled:
            if request.client_gone:
                stats.disconnects += 1
            raise
        finally:
            stats.inflight -= 1

    async def _serve(self, request: Request, writer: ResponseWriter, body: object) -> None:
        behaviour = self.behaviour
        failing = behaviour.take_failure()
        answer: bytes | None = None
        problem: str | None = None
        if not isinstance(body, dict):
            problem = "the request body must be a JSON object"
        else:
            try:
                answer = orjson.dumps(POOLING_ROUTES[request.path](body, self._context()))
            except BadGenerationRequest as exc:
                problem = str(exc)
        if failing:
            self.routing.failures += 1
            if behaviour.fail_mode is FailMode.MIDSTREAM:
                await break_unary(request, writer, answer or _PLACEHOLDER)
            else:
                await serve_failure(behaviour, request, writer, streaming=False)
            return
        if answer is None:
            await writer.respond(
                400,
                JSON_HEADERS,
                error_body(problem or "bad request", "invalid_request_error", 400),
            )
            return
        load = self.routing.loads[0]
        load.running += 1
        try:
            await writer.respond(200, JSON_HEADERS, answer)
        finally:
            load.running -= 1

    def _context(self) -> PoolingContext:
        self._next_id += 1
        settings = self.settings
        return PoolingContext(
            model=settings.model,
            engine=settings.engine,
            embedding_dim=settings.embedding_dim,
            request_id=f"fake-{self._next_id}",
            created=int(time.time()),  # wall-clock: OpenAI `created`
            max_model_len=settings.max_model_len,
            model_tokens=self.model_tokens,
        )

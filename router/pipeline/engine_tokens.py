"""A request's token ids for `kv_aware`, once per request, before its first pick.

The local sources first (the model's tokenizer read here: `router.prompts.token_sources`);
when they cannot give the ids (no local tokenizer, a chat shape the local renderer does
not reproduce, text without a tokenizer) and the model's chain allows it, one of the
model's engines is asked (`POST /tokenize`, `router.prompts.tokenize_request`) through the
upstream pool. That ask is bounded three ways: a short deadline (`timeout_s`), a cap on
asks in flight (`max_concurrent`; past it the request is not delayed but placed by
load), and its answer is trusted only when it reads as token ids. Whatever goes wrong
(no engine to ask, a refusal, a timeout, a broken connection, garbage, a count that
disagrees with its list) costs the client nothing: the request gets no prediction, counted
by why, and is served as usual. The ask never touches a breaker or a worker's load.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import trio

from router.fleet.registry import Worker
from router.http import clock
from router.http.upstream.exceptions import LocalShortage, UpstreamError
from router.http.upstream.pool import UpstreamRequests
from router.pipeline.resolve import GenerationRequest
from router.policies.kv_aware import CHAT, NO_TOKENS, tokens_or_reason
from router.prompts.chat_request import NotRendered
from router.prompts.token_sources import TokenSources, tokenizing_workers
from router.prompts.tokenize_request import BadTokens, read_tokens, tokenize_body

ASK_OUTCOMES: Final = ("ok", "timeout", "refused", "failed", "bad_answer", "busy", "not_asked")
"""How an ask of an engine's /tokenize ended: token ids (`ok`); no answer in time
(`timeout`); an answer other than 200 (`refused`); a transport error (`failed`); an
answer that is not token ids (`bad_answer`); too many asks in flight (`busy`, not asked);
no engine of the request's candidates could be asked for its shape (`not_asked`)."""

ENGINE_TOKENIZE: Final = "engine_tokenize"
"""The no-prediction reason of a request whose engine ask failed."""


@dataclass(frozen=True, slots=True)
class EngineTokenSettings:
    timeout_s: float = 0.5
    max_concurrent: int = 64


class EngineTokens:
    """Resolves requests' token ids; `asks` counts the engine asks by outcome."""

    def __init__(
        self,
        sources: TokenSources,
        pool: UpstreamRequests,
        settings: EngineTokenSettings,
        worker_api_key: str = "",
    ) -> None:
        self.sources = sources
        self.pool = pool
        self.settings = settings
        self._credential = f"Bearer {worker_api_key}".encode() if worker_api_key else None
        self._limiter = trio.CapacityLimiter(settings.max_concurrent)
        self._turn = itertools.count()
        self.asks: dict[str, int] = dict.fromkeys(ASK_OUTCOMES, 0)
        self.ask_seconds = 0.0
        """Time spent waiting for engines' answers, summed (the added latency)."""

    async def resolve(
        self, generation: GenerationRequest, candidates: Sequence[Worker], request_id: bytes
    ) -> list[int] | str:
        """The request's token ids, or why there are none (a `kv_aware` no-prediction
        reason). Cancellation: the ask's upstream connection is closed."""
        chain = self.sources.chain(generation.model)
        found = tokens_or_reason(generation.body, chain.local, generation.route)
        if isinstance(found, list) or found not in (NO_TOKENS, CHAT) or not chain.engine:
            return found
        workers = tokenizing_workers(candidates)
        try:
            if not workers:
                raise NotRendered("no candidate's engine answers /tokenize")
            worker = workers[next(self._turn) % len(workers)]
            body = tokenize_body(generation.model, generation.body, generation.route, worker.engine)
        except NotRendered:
            self.asks["not_asked"] += 1
            return found
        try:
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            self.asks["busy"] += 1
            return ENGINE_TOKENIZE
        started = clock.now()
        try:
            outcome, tokens = await self._ask(worker, body, request_id)
        finally:
            self._limiter.release()
            self.ask_seconds += clock.now() - started
        self.asks[outcome] += 1
        return tokens if tokens is not None else ENGINE_TOKENIZE

    async def _ask(
        self, worker: Worker, body: bytes, request_id: bytes
    ) -> tuple[str, list[int] | None]:
        headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id)]
        key = worker.record.api_key
        credential = f"Bearer {key}".encode() if key else self._credential
        if credential is not None:
            headers.append((b"authorization", credential))
        with trio.move_on_after(self.settings.timeout_s) as deadline:
            try:
                async with self.pool.request(
                    worker.url,
                    "POST",
                    "/tokenize",
                    headers,
                    body,
                    connect_timeout_s=self.settings.timeout_s,
                ) as response:
                    whole = response.take_whole_body()
                    parts = [] if whole is None else [whole]
                    if whole is None:
                        while chunk := await response.receive_some():
                            parts.append(chunk)
                    status = response.status
            except (UpstreamError, LocalShortage):
                return "failed", None
        if deadline.cancelled_caught:
            return "timeout", None
        if status != 200:
            return "refused", None
        try:
            return "ok", read_tokens(b"".join(parts))
        except BadTokens:
            return "bad_answer", None

    def statistics(self) -> Mapping[str, Any]:
        return {**{f"asks_{k}": v for k, v in self.asks.items()}, "ask_seconds": self.ask_seconds}

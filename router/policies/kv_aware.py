"""`kv_aware`: send a request to the worker (and DP rank) whose engine reports holding the
longest run of its prompt's KV blocks, unless its load costs more than the blocks save.

The holdings are the engines' own (`router.engines.kv_events`: their `BlockStored` /
`BlockRemoved` / `AllBlocksCleared` events, indexed per model under keys the router
computes itself). Per request:

1. The token ids the engine will compute (`request_tokens`): `/generate`'s `input_ids`
   and a completions prompt of token ids are their own tokens; a completions prompt
   string and `/generate`'s `text` are encoded with the model's tokenizer when one is
   given (`--kv-tokenizer`: a `tokenizer.json` for the `tokenizers` library, or the
   model's directory holding one; special tokens added as vLLM and SGLang add them).
   Given the model's directory, chat, plain Responses and text-only Messages bodies are
   rendered with the model's chat template as vLLM renders them
   (`router.prompts.chat_template`) and the prompt encoded as vLLM encodes it. A
   request whose tokens the router cannot compute (text without a tokenizer, chat
   without a template or of a shape the router does not render, a template that raised
   for it) gets no prediction and is placed by load alone, counted by reason.
2. Its full blocks' keys are matched against the model's index: per known view (worker,
   rank), the consecutive blocks held from the first.
3. Each candidate costs `overlap_weight x uncached blocks / typical prompt blocks +
   load` (`Worker.load`: the engine's own count of requests plus what this process sent
   that it cannot have counted yet, or this process's own count while the engine's is
   unknown; for a rank-multiplexed worker its best rank's run with that rank's load); the
   lowest cost wins, ties to the lower load, then in turn (the scan starts one candidate
   further on each pick, as `least_load`'s does). With a spread margin, a candidate that
   holds as many blocks as the best and costs within the margin of it is drawn at random
   instead (`router.policies.spread`), so replicas reading the same events and loads do
   not all choose the same engine, and none leaves a prompt's cache for a near-tie of
   cost. The typical prompt is a moving average of the predicted
   requests' blocks, so the weight reads the same whatever the block size and prompt
   length: recomputing a typical prompt from scratch costs `overlap_weight` requests in
   flight. A candidate whose views are all unknown (a gap the replay could not repair, a
   publisher that is gone) or absent (no subscription) is scored as holding nothing and
   counted, never read as a hit.
4. The chosen view's blocks count as held for a short time (`KvIndex.note_routed`), so a
   burst of one new prefix does not spread before the engine's events arrive.

A request for a LoRA adapter is tokenized as its base model's, and looked up in the base
model's index under keys namespaced by the adapter (the engines' `BlockStored` events
carry `lora_name`, which our keys chain in; the base model is its own namespace), so an
adapter's blocks never count as the base model's nor another adapter's. Its cost on each
candidate adds what the adapter costs there (`router.policies.adapter_affinity`: running
it, a free slot, a wait).

Pure and synchronous: `clock` (the caller's, trio's in the router) is read once per pick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from router.engines.kv_events.decode import ExtraKey
from router.engines.kv_events.fleet_views import KvIndexes
from router.engines.kv_events.index import MatchResult, ViewId
from router.fleet.records import Role
from router.fleet.registry import Worker
from router.policies.adapter_affinity import AdapterAffinitySettings, adapter_cost
from router.policies.spread import NearTies, deterministic
from router.prompts.chat_request import NotRendered
from router.prompts.chat_template import TemplateFailed
from router.prompts.tokenizer import TextTokenizer

_Scored = tuple[Worker, int, "ViewId | None"]
"""A candidate as scored: the worker, the blocks its best view holds, that view."""


@dataclass(frozen=True, slots=True)
class KvAwareSettings:
    overlap_weight: float = 2.0
    """Cost of recomputing a typical prompt (its blocks all uncached), in requests in
    flight: a candidate holding half a typical prompt saves `overlap_weight / 2`."""


TYPICAL_BLOCKS_WINDOW: Final = 64
"""Predicted requests the typical prompt's moving average spans (its smoothing factor is
1 / this): long enough that one huge prompt does not swing the cost, short enough to
follow a change of workload within a few hundred requests."""


@dataclass(frozen=True, slots=True)
class KvPolicyInputs:
    """What a `kv_aware` policy is built from: its settings, the indexes the fleet's
    subscriptions keep, the clock it reads once per pick, and the model's local tokenizer
    (`local(model)`, `router.prompts.token_sources`; else one `tokenizer` for every model)."""

    settings: KvAwareSettings
    indexes: KvIndexes
    clock: Callable[[], float]
    tokenizer: TextTokenizer | None = None
    local: Callable[[str], TextTokenizer | None] | None = None


class RequestKey(Protocol):
    """What the policy reads of a request's `PolicyKey`."""

    @property
    def model(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def body(self) -> Mapping[str, Any] | None: ...

    @property
    def route(self) -> str: ...

    @property
    def tokens(self) -> list[int] | str | None: ...

    @property
    def base_model(self) -> str | None: ...

    @property
    def adapter(self) -> str | None: ...


# Why a request got no prediction (the `reason` label of the counter).
NO_TOKENS: Final = "no_tokens"
"""The router cannot compute the engine's tokens (text without a tokenizer, batches)."""
CHAT: Final = "chat_template"
"""Chat, Responses and Messages the router does not render as the engine does: no chat
template (a `tokenizer.json` alone), a shape it does not reproduce (media, tools in
Messages, a request's own template, ...; `router.prompts.chat_template`)."""
TEMPLATE_ERROR: Final = "template_error"
"""The chat template raised for the request, or ran past its render bounds."""
ENGINE_TOKENIZE: Final = "engine_tokenize"
"""The engine was asked for the request's tokens and gave none in time (refused, timed
out, broke, answered garbage, or too many asks were in flight)."""
NO_INDEX: Final = "no_index"
"""No event of the model has arrived yet (no index, or its block size unknown)."""
SHORT_PROMPT: Final = "short_prompt"
"""Fewer tokens than one block: nothing can be cached."""
NO_PREDICTION_REASONS: Final = (
    NO_TOKENS,
    CHAT,
    TEMPLATE_ERROR,
    ENGINE_TOKENIZE,
    NO_INDEX,
    SHORT_PROMPT,
)
PICK_REASONS: Final = ("match", "load", "no_prediction")


def is_chat(body: Mapping[str, Any] | None) -> bool:
    return body is not None and ("messages" in body or "input" in body)


def request_tokens(
    body: Mapping[str, Any] | None, tokenizer: TextTokenizer | None = None, route: str = ""
) -> list[int] | None:
    """The token ids the engine computes for `body`: `input_ids` of `/generate`, a
    completions prompt of ids, and with a tokenizer a completions prompt string,
    `/generate`'s `text`, and chat rendered with the model's template. None otherwise
    (a batch of prompts, text without a tokenizer, chat the router does not render)."""
    tokens = tokens_or_reason(body, tokenizer, route)
    return tokens if isinstance(tokens, list) else None


def tokens_or_reason(
    body: Mapping[str, Any] | None, tokenizer: TextTokenizer | None, route: str = ""
) -> list[int] | str:
    """`request_tokens`, or why there are none (one of `NO_PREDICTION_REASONS`)."""
    if body is None:
        return NO_TOKENS
    if is_chat(body):
        if tokenizer is None:
            return CHAT
        try:
            return tokenizer.chat_tokens(body, anthropic=route == "messages")
        except NotRendered:
            return CHAT
        except TemplateFailed:
            return TEMPLATE_ERROR
    for field in ("input_ids", "prompt", "text"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, list) and value and _is_ids(value):
            return value
        if isinstance(value, str) and tokenizer is not None and field != "input_ids":
            return tokenizer.encode(value)
        return NO_TOKENS
    return NO_TOKENS


def _salt_keys(body: Mapping[str, Any] | None) -> list[ExtraKey | None] | None:
    """vLLM's `cache_salt` as its events carry it: the first block's extra key, alone."""
    salt = body.get("cache_salt") if body is not None else None
    return [(salt,)] if isinstance(salt, str) and salt else None


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(item, int) and not isinstance(item, bool) for item in value)


class KvAware:
    """The kv-aware policy; `statistics()` reports its predictions and picks."""

    __slots__ = (
        "_clock",
        "_start",
        "adapters",
        "indexes",
        "local",
        "no_prediction",
        "picks",
        "predicted_hit_tokens",
        "predicted_prompt_tokens",
        "predictions",
        "settings",
        "ties",
        "tokenizer",
        "typical_blocks",
        "unknown_candidates",
    )

    def __init__(
        self,
        settings: KvAwareSettings,
        indexes: KvIndexes,
        clock: Callable[[], float],
        tokenizer: TextTokenizer | None = None,
        ties: NearTies | None = None,
        local: Callable[[str], TextTokenizer | None] | None = None,
        adapters: AdapterAffinitySettings | None = None,
    ) -> None:
        self.settings = settings
        self.adapters = adapters or AdapterAffinitySettings()
        self.tokenizer = tokenizer
        self.local = local
        self.ties = ties or deterministic()
        self.indexes = indexes
        self._clock = clock
        # Where the scan starts, per (model, role): equal costs (an idle fleet, prompts
        # nobody holds) take turns instead of all going to the first candidate.
        self._start: dict[tuple[str, Role], int] = {}
        self.predictions = 0
        self.no_prediction: dict[str, int] = dict.fromkeys(NO_PREDICTION_REASONS, 0)
        self.picks: dict[str, int] = dict.fromkeys(PICK_REASONS, 0)
        self.unknown_candidates = 0
        """Candidates scored as holding nothing because their views are unknown."""
        self.predicted_prompt_tokens = 0
        """Tokens of the requests predicted."""
        self.predicted_hit_tokens = 0
        """Of those, the ones the chosen engine should find in its prefix cache."""
        self.typical_blocks: float | None = None
        """The moving average of the predicted requests' full blocks; None before the
        first prediction (that request's own blocks stand in for it)."""

    def pick(self, key: RequestKey, candidates: Sequence[Worker]) -> Worker:
        return self.pick_ranked(key, candidates)[0]

    def pick_ranked(
        self, key: RequestKey, candidates: Sequence[Worker]
    ) -> tuple[Worker, int | None]:
        """The pick and, for a rank-multiplexed worker, the DP rank whose view holds the
        longest run (the least loaded of equal runs); None without a prediction, so the
        pipeline takes its least-loaded rank."""
        # An adapter's prompt is its base model's tokens, its blocks in that model's index.
        model = key.base_model or key.model
        adapter = key.adapter
        found = key.tokens
        if found is None:
            tokenizer = self.local(model) if self.local is not None else self.tokenizer
            found = tokens_or_reason(key.body, tokenizer, key.route)
        tokens = found if isinstance(found, list) else []
        reason = found if isinstance(found, str) else None
        index = self.indexes.get(model)
        if reason is None:
            if index is None or index.block_size is None:
                reason = NO_INDEX
            elif len(tokens) < index.block_size:
                reason = SHORT_PROMPT
        count = len(candidates)
        state_key = (key.model, key.role)
        start = self._start.get(state_key, 0) % count
        self._start[state_key] = (start + 1) % count
        if reason is not None or index is None:
            self.no_prediction[reason or NO_INDEX] += 1
            self.picks["no_prediction"] += 1
            loads = [
                (worker.load + self._adapter_cost(worker, adapter), worker) for worker in candidates
            ]
            best_idle = start
            for offset in range(1, count):
                position = (start + offset) % count
                if loads[position][0] < loads[best_idle][0]:
                    best_idle = position
            return self.ties.choose(loads, best_idle), None
        now = self._clock()
        keys = index.block_keys(tokens, lora_name=adapter, extra_keys=_salt_keys(key.body))
        result = index.match(keys, now)
        self.predictions += 1
        weight = self.settings.overlap_weight / self._typical(result.blocks)
        scored: list[tuple[float, _Scored]] = []
        best = 0
        best_score: tuple[float, float] = (0.0, 0.0)
        for offset in range(count):
            worker = candidates[(start + offset) % count]
            held, load, view = self._held(worker, result)
            load += self._adapter_cost(worker, adapter)
            score = (weight * (result.blocks - held) + load, load)
            if offset == 0 or score < best_score:
                best, best_score = offset, score
            scored.append((score[0], (worker, held, view)))
        # Near-ties are broken only among candidates holding as many blocks as the best:
        # every replica reads the same events, so it is the load alone they would herd on;
        # a margin that also weighed blocks would send a conversation away from its cache.
        most_held = scored[best][1][1]
        equals: list[tuple[float, _Scored]] = []
        best_among_equals = 0
        for position, item in enumerate(scored):
            if item[1][1] == most_held:
                if position == best:
                    best_among_equals = len(equals)
                equals.append(item)
        best_worker, best_held, best_view = self.ties.choose(equals, best_among_equals)
        self.picks["match" if best_held > 0 else "load"] += 1
        self.predicted_prompt_tokens += len(tokens)
        # What the engine's prefix cache will count as hits: whole blocks, and never the
        # last prompt token (an engine always computes it, so a fully cached prompt
        # gives back its last block).
        block_size = index.block_size or 0
        hit_blocks = min(best_held, (len(tokens) - 1) // block_size) if block_size else 0
        self.predicted_hit_tokens += hit_blocks * block_size
        if best_view is None:
            return best_worker, None
        index.note_routed(keys, best_view[0], best_view[1], now)
        return best_worker, best_view[1]

    def _adapter_cost(self, worker: Worker, adapter: str | None) -> float:
        return 0.0 if adapter is None else adapter_cost(worker, adapter, self.adapters)

    def _typical(self, blocks: int) -> float:
        """The typical prompt's blocks, this request's `blocks` folded in (at least 1)."""
        typical = self.typical_blocks
        if typical is None:
            typical = float(blocks)
        else:
            typical += (blocks - typical) / TYPICAL_BLOCKS_WINDOW
        self.typical_blocks = typical
        return max(typical, 1.0)

    def _held(self, worker: Worker, result: MatchResult) -> tuple[int, float, ViewId | None]:
        """The worker's longest held run over its views, that view's load, and the view
        (None when none is known)."""
        record = worker.record
        views: list[tuple[ViewId, float]]
        if record.rank_multiplexed:
            views = [
                ((worker.id, rank), worker.rank_load(rank))
                for rank in range(len(worker.rank_inflight))
            ]
        else:
            views = [((worker.id, record.dp_rank), worker.load)]
        best_held = -1
        best_load = worker.load
        best_view: ViewId | None = None
        for view, load in views:
            held = result.runs.get(view)
            if held is None:
                continue  # unknown, or never subscribed
            if held > best_held or (held == best_held and load < best_load):
                best_held, best_load, best_view = held, load, view
        if best_view is None:
            self.unknown_candidates += 1
            return 0, worker.load, None
        return best_held, best_load, best_view

    def statistics(self) -> dict[str, int]:
        stats = {
            "predictions": self.predictions,
            "unknown_candidates": self.unknown_candidates,
            "predicted_prompt_tokens": self.predicted_prompt_tokens,
            "predicted_hit_tokens": self.predicted_hit_tokens,
        }
        for reason, count in self.no_prediction.items():
            stats[f"no_prediction_{reason}"] = count
        for reason, count in self.picks.items():
            stats[f"picks_by_{reason}"] = count
        return stats

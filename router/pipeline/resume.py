"""Which streams may go on on another worker when theirs breaks, and the request that
continues one: pure decisions, no I/O.

A stream resumes exactly or not at all. It is in the envelope when the router can make
the rest of the answer itself from token ids, as the broken engine would have made it:
one sequence (n = 1), plain text out (no structured output, no tools), and nothing asked
of the answer that the router does not rebuild (logprobs, echo, usage on every event,
media in the prompt). Whatever is outside it ends, as before, with the API's error event,
and the break is counted with its reason (`Refusal`).

The continuation is the same request with the prompt given as ids: the original prompt's
ids and every id generated so far (completions: `prompt`; chat: vLLM's
`kv_transfer_params.prompt_token_ids`, which takes the place of rendering the
messages), the token budget lowered by what was generated (always explicit where the
router knows it: completions default to 16), `min_tokens` likewise, and what the router
handles itself taken out: `stop` (checked by the router across the seam), `echo` and
`prompt_logprobs`. Under greedy decoding the continuation generates exactly what the
broken worker would have; seeded sampling and frequency or presence penalties (which
count the generated tokens, now part of the prompt) give a valid sample, not the same one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "OPT_OUT_HEADER",
    "RESUMABLE_ROUTES",
    "Outcome",
    "Refusal",
    "ResumeSettings",
    "continuation_body",
    "envelope",
    "parse_routes",
    "token_limit",
]

RESUMABLE_ROUTES: Final = frozenset({"chat", "completions"})
"""The APIs whose streams the router can continue (vLLM takes their prompts as ids)."""

OPT_OUT_HEADER: Final = b"x-router-resume"
"""A request with `X-Router-Resume: off` is never resumed (nor are its ids asked for)."""

COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16
"""OpenAI's (and vLLM's) `max_tokens` of a completions request that sets none."""


class Refusal(enum.StrEnum):
    """Why a broken stream was not resumed (`router_resume_refusals_total{reason}`)."""

    DISABLED = "disabled"
    """`--resume-limit 0`, the route left out of `--resume-routes`, or `X-Router-Resume: off`."""
    ROUTE = "route"
    """An API the router does not continue (`/generate`, Responses, Messages)."""
    CHOICES = "n"
    """More than one sequence: `n` or `best_of` above 1, beam search, a batch of prompts."""
    STRUCTURED_OUTPUT = "structured_output"
    """`response_format` other than text, guided decoding, `structured_outputs`."""
    TOOLS = "tools"
    """Tools offered: a tool call after the seam would come out as plain text."""
    OPTION = "option"
    """Something asked of the answer the router does not rebuild: logprobs, `echo`, usage
    on every event, media in the prompt, special-token spacing, no detokenization."""
    TOOL_CALL_OPEN = "tool_call_open"
    """The answer had begun a tool call."""
    REASONING_OPEN = "reasoning_open"
    """The answer had reasoning in it (the router's text after the seam is plain content)."""
    HELD_BACK = "held_back"
    """The client got other text than the ids account for (text the engine held back
    beyond a stop-string buffer, or a tokenizer that decodes otherwise)."""
    NO_IDS = "no_ids"
    """The worker gave no token ids (or its engine is not asked: not vLLM)."""
    NO_TOKENIZER = "no_tokenizer"
    """The router has no tokenizer for the model to make the text after the seam."""
    IDS_BOUND = "ids_bound"
    """Prompt and answer held more ids than `--resume-max-ids`."""
    LIMIT = "limit"
    """The request already resumed `--resume-limit` times."""


class Outcome(enum.StrEnum):
    """What became of a stream's break (`router_resumes_total{outcome}`)."""

    RESUMED = "resumed"
    """The stream went on (a continuation, or the end the engine had reached)."""
    REFUSED = "refused"
    """Ended with the error event: not resumable (`Refusal`)."""
    FAILED = "failed"
    """Ended with the error event: no worker could take the continuation."""


@dataclass(frozen=True, slots=True)
class ResumeSettings:
    limit: int = 0
    """Resumes per request (`--resume-limit`); 0: streams are never resumed."""
    routes: frozenset[str] = RESUMABLE_ROUTES
    """Routes that resume (`--resume-routes`)."""
    max_ids: int = 65_536
    """Ids (prompt and answer) kept per stream (`--resume-max-ids`); a longer one is not
    resumable."""

    def enabled(self, route: str) -> bool:
        return self.limit > 0 and route in self.routes


_STRUCTURED_FIELDS: Final = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "structured_outputs",
)


def parse_routes(text: str) -> frozenset[str]:
    """`--resume-routes`: comma-separated route names of `RESUMABLE_ROUTES` (none: empty);
    ValueError for any other."""
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - RESUMABLE_ROUTES)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: only {', '.join(sorted(RESUMABLE_ROUTES))} streams resume"
        )
    return names


def envelope(route: str, body: Mapping[str, Any]) -> Refusal | None:
    """Why a stream of `body` on `route` cannot resume exactly, or None when it can."""
    if route not in RESUMABLE_ROUTES:
        return Refusal.ROUTE
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return Refusal.CHOICES
    if body.get("use_beam_search") is True:
        return Refusal.CHOICES
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1 or not isinstance(prompt[0], str):
                return Refusal.CHOICES
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return Refusal.STRUCTURED_OUTPUT
    if any(body.get(name) is not None for name in _STRUCTURED_FIELDS):
        return Refusal.STRUCTURED_OUTPUT
    if (body.get("tools") and body.get("tool_choice") != "none") or body.get("functions"):
        return Refusal.TOOLS
    if _asks_what_is_not_rebuilt(route, body):
        return Refusal.OPTION
    return None


def _asks_what_is_not_rebuilt(route: str, body: Mapping[str, Any]) -> bool:
    if body.get("echo") is True or body.get("prompt_embeds") is not None:
        return True
    logprobs = body.get("logprobs")
    if (logprobs is True) if route == "chat" else (logprobs is not None):
        return True
    if body.get("top_logprobs") is not None and body.get("top_logprobs") != 0:
        return True
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("continuous_usage_stats") is True:
        return True
    if "return_token_ids" in body and body["return_token_ids"] is not True:
        return True  # an explicit false the router would have to overrule
    if body.get("spaces_between_special_tokens") is False or body.get("detokenize") is False:
        return True
    if route == "chat":
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, list) and any(
                not isinstance(part, Mapping) or part.get("type", "text") != "text"
                for part in content
            ):
                return True  # vLLM renders media itself and ignores prompt ids beside it
    return False


def token_limit(route: str, body: Mapping[str, Any]) -> int | None:
    """The answer's token budget as the engine reads it; None when the request leaves it
    to the engine (chat: the rest of the model's context)."""
    if route == "completions":
        limit = body.get("max_tokens")
        return COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else int(limit)
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    return None if limit is None else int(limit)


def continuation_body(
    route: str,
    body: Mapping[str, Any],
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    *,
    max_model_len: int | None = None,
) -> tuple[dict[str, Any], bytes]:
    """The request that continues `body` after `generated` on another worker (parsed, and
    as bytes): the prompt
    as ids (`prompt_ids` then `generated`), the budget lowered by `len(generated)`
    (explicit: a chat request without one gets what the model's context leaves, when
    `max_model_len` is known), `min_tokens` likewise; streamed, with token ids; without
    `stop`, `echo` and `prompt_logprobs`. The caller checks that budget is left."""
    out = dict(body)
    for name in ("echo", "prompt_logprobs", "stop"):
        out.pop(name, None)
    out["stream"] = True
    out["return_token_ids"] = True
    ids = [*prompt_ids, *generated]
    done = len(generated)
    limit = token_limit(route, body)
    if route == "completions":
        out["prompt"] = ids
        assert limit is not None
        out["max_tokens"] = limit - done
    else:
        params = body.get("kv_transfer_params")
        kv = dict(params) if isinstance(params, Mapping) else {}
        kv["prompt_token_ids"] = ids
        out["kv_transfer_params"] = kv
        left = limit - done if limit is not None else None
        if left is None and max_model_len is not None:
            left = max_model_len - len(ids)
        if left is not None:
            fields = [f for f in ("max_completion_tokens", "max_tokens") if out.get(f) is not None]
            for name in fields or ["max_tokens"]:
                out[name] = left
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
        out["min_tokens"] = max(0, min_tokens - done)
    return out, orjson.dumps(out)

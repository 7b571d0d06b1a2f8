"""Which streams may resume, and the request that continues one: the envelope refuses what
cannot go on exactly, and the continuation carries the prompt as ids with the budget left."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.pipeline.resume import Refusal, continuation_body, envelope, parse_routes

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETIONS: dict[str, Any] = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("route", "extra", "reason"),
    [
        ("generate", {}, Refusal.ROUTE),
        ("responses", {}, Refusal.ROUTE),
        ("chat", {"n": 2}, Refusal.CHOICES),
        ("completions", {"best_of": 3}, Refusal.CHOICES),
        ("completions", {"prompt": ["a", "b"]}, Refusal.CHOICES),
        ("completions", {"prompt": [[1, 2], [3]]}, Refusal.CHOICES),
        ("chat", {"response_format": {"type": "json_object"}}, Refusal.STRUCTURED_OUTPUT),
        ("chat", {"guided_regex": "a+"}, Refusal.STRUCTURED_OUTPUT),
        ("completions", {"structured_outputs": {"choice": ["a"]}}, Refusal.STRUCTURED_OUTPUT),
        ("chat", {"tools": [{"type": "function"}]}, Refusal.TOOLS),
        ("chat", {"logprobs": True}, Refusal.OPTION),
        ("completions", {"logprobs": 0}, Refusal.OPTION),
        ("completions", {"echo": True}, Refusal.OPTION),
        ("chat", {"stream_options": {"continuous_usage_stats": True}}, Refusal.OPTION),
        ("chat", {"return_token_ids": False}, Refusal.OPTION),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            Refusal.OPTION,
        ),
    ],
)
def test_the_envelope_refuses_what_cannot_go_on_exactly(
    route: str, extra: dict[str, Any], reason: Refusal
) -> None:
    base = CHAT if route == "chat" else COMPLETIONS
    assert envelope(route, {**base, **extra}) is reason


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("chat", {}),
        ("chat", {"n": 1, "tools": [{"type": "function"}], "tool_choice": "none"}),
        ("chat", {"response_format": {"type": "text"}, "seed": 7, "presence_penalty": 0.5}),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        ("completions", {"prompt": [1, 2, 3], "stop": ["x"], "return_token_ids": True}),
        ("completions", {"prompt": ["one prompt"], "logprobs": None}),
    ],
)
def test_the_envelope_takes_plain_single_sequences(route: str, extra: dict[str, Any]) -> None:
    base = CHAT if route == "chat" else COMPLETIONS
    assert envelope(route, {**base, **extra}) is None


def test_a_completions_continuation_sends_the_ids_and_the_budget_left() -> None:
    body = {**COMPLETIONS, "stop": ["x"], "echo": True, "prompt_logprobs": 2, "min_tokens": 5}
    parsed, raw = continuation_body("completions", body, [9, 8], [0, 1, 2])
    assert orjson.loads(raw) == parsed
    assert parsed["prompt"] == [9, 8, 0, 1, 2]
    assert parsed["max_tokens"] == 16 - 3  # completions' default, made explicit
    assert parsed["min_tokens"] == 2
    assert (parsed["stream"], parsed["return_token_ids"]) == (True, True)
    assert not {"stop", "echo", "prompt_logprobs"} & parsed.keys()


def test_a_chat_continuation_gives_the_prompt_as_ids_and_lowers_the_limit_it_set() -> None:
    body = {**CHAT, "max_completion_tokens": 10, "kv_transfer_params": {"other": 1}}
    parsed, _ = continuation_body("chat", body, [5, 6], [0, 1])
    assert parsed["kv_transfer_params"] == {"other": 1, "prompt_token_ids": [5, 6, 0, 1]}
    assert parsed["max_completion_tokens"] == 8
    assert "max_tokens" not in parsed
    assert parsed["messages"] == CHAT["messages"]  # vLLM still checks them


def test_a_chat_continuation_without_a_limit_gets_the_context_left_when_it_is_known() -> None:
    known, _ = continuation_body("chat", CHAT, [5, 6], [0, 1], max_model_len=100)
    unknown, _ = continuation_body("chat", CHAT, [5, 6], [0, 1])
    assert known["max_tokens"] == 96
    assert "max_tokens" not in unknown and "max_completion_tokens" not in unknown


def test_resume_routes_are_chat_and_completions_only() -> None:
    assert parse_routes("chat, completions") == {"chat", "completions"}
    assert parse_routes("") == frozenset()
    with pytest.raises(ValueError, match="generate"):
        parse_routes("chat,generate")

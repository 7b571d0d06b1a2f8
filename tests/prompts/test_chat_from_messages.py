"""Anthropic Messages bodies rendered as vLLM converts them into a chat request: text-only
conversations get the ids of the equivalent chat body's prompt; what vLLM would convert
after probing the template, tools and blocks other than text are no prediction.
(tests/engine/test_chat_tokens.py holds the counts against a real engine.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conformance.tiny_model import BOS, CHAT_TEMPLATE, EOS
from router.fleet.records import Role
from router.policies.kv_aware import CHAT, request_tokens, tokens_or_reason
from router.policies.policy import PolicyKey
from router.prompts.chat_request import NotRendered
from router.prompts.chat_template import ChatTemplate
from router.prompts.tokenizer import HfTokenizer
from tests.prompts.test_chat_template import (
    MODEL,
    RENDERED,
    encoded,
    setup_policy,
    store,
)
from tests.support.model_dir import write_model

USER = {"role": "user", "content": "tell me about the cache"}


@pytest.fixture
def tokenizer(tmp_path: Path) -> HfTokenizer:
    return HfTokenizer(write_model(tmp_path))


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [USER], **fields}


def test_system_first_then_the_turns_as_the_equivalent_chat_body(tokenizer: HfTokenizer) -> None:
    expected = encoded(RENDERED)
    for system in (
        "you are a router",
        [{"type": "text", "text": "you are "}, {"type": "text", "text": "a router"}],
        [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=5"},
            {"type": "text", "text": "you are a router", "cache_control": {"type": "ephemeral"}},
        ],
    ):
        assert request_tokens(messages(system=system), tokenizer, "messages") == expected
    blocks = {"role": "user", "content": [{"type": "text", "text": "tell me about the cache"}]}
    body = messages(system="you are a router", messages=[blocks])
    assert request_tokens(body, tokenizer, "messages") == expected
    # A user message with no text is left out, as vLLM leaves it out.
    empty = {"role": "user", "content": [{"type": "text", "text": ""}]}
    body = messages(system="you are a router", messages=[empty, USER])
    assert request_tokens(body, tokenizer, "messages") == expected
    # Several text blocks are parts, as chat's parts are.
    two = {"role": "user", "content": [{"type": "text", "text": t} for t in ("one", "two")]}
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, "two"]}]}
    assert request_tokens(messages(messages=[two]), tokenizer, "messages") == request_tokens(
        chat, tokenizer
    )


def test_the_chat_route_still_refuses_anthropic_fields(tokenizer: HfTokenizer) -> None:
    assert tokens_or_reason(messages(system="you are a router"), tokenizer, "chat") == CHAT


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"thinking": {"type": "disabled"}}, "thinking disabled"),
        ({"output_config": {"effort": "low"}}, "output_config"),
        ({"tools": [{"name": "weather", "input_schema": {"type": "object"}}]}, "tools"),
        ({"messages": [{"role": "system", "content": "inline"}, USER]}, "not a user"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "u"}}],
                    }
                ]
            },
            "a image block",
        ),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
                ]
            },
            "a thinking block",
        ),
        ({"messages": [USER, {"role": "assistant", "content": []}]}, "without text"),
        ({"system": 5}, "neither a string nor a list"),
        # Unhashable values where a name is expected: no prediction, never a TypeError.
        ({"messages": [{"role": []}]}, "not a user or assistant"),
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "not a user or assistant"),
        ({"messages": [{"role": "user", "content": [{"type": []}]}]}, "a block"),
        ({"system": [{"type": {"a": 1}, "text": "x"}]}, "a block"),
    ],
)
def test_what_vllm_converts_otherwise_is_not_rendered(fields: dict[str, Any], why: str) -> None:
    template = ChatTemplate({"default": CHAT_TEMPLATE}, {"bos_token": BOS, "eos_token": EOS})
    with pytest.raises(NotRendered, match=why):
        template.render(messages(**fields), anthropic=True)


def test_enabled_thinking_sets_no_template_argument_and_is_rendered(
    tokenizer: HfTokenizer,
) -> None:
    body = messages(system="you are a router", thinking={"type": "enabled", "budget_tokens": 1024})
    assert request_tokens(body, tokenizer, "messages") == encoded(RENDERED)


def test_a_messages_request_goes_to_the_worker_holding_its_prompt(tokenizer: HfTokenizer) -> None:
    policy, indexes, fleet = setup_policy(tokenizer, 0, 1)
    store(indexes, "w1", encoded(RENDERED))
    body = messages(system=[{"type": "text", "text": "you are a router"}])
    key = PolicyKey(MODEL, Role.MIXED, body=body, route="messages")
    assert policy.pick(key, fleet).id == "w1"
    stats = policy.statistics()
    assert stats["picks_by_match"] == 1 and stats["no_prediction_chat_template"] == 0

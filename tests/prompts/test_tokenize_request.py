"""What the router asks an engine's /tokenize for each route, and what of its answer it
trusts."""

from __future__ import annotations

import orjson
import pytest

from router.prompts.chat_request import NotRendered
from router.prompts.tokenize_request import MAX_TOKENS, BadTokens, read_tokens, tokenize_body

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
    "temperature": 0,
    "add_generation_prompt": True,
    "chat_template_kwargs": {"enable_thinking": False},
}


def asked(route: str, body: dict[str, object], engine: str | None = "vllm") -> object:
    return orjson.loads(tokenize_body("m", body, route, engine))


def test_a_chat_request_asks_with_its_messages_and_template_arguments_only() -> None:
    assert asked("chat", CHAT) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_what_a_chat_request_hands_its_template_goes_in_the_kwargs() -> None:
    body = {**CHAT, "reasoning_effort": "low", "documents": [{"title": "a", "text": "b"}]}
    kwargs = asked("chat", body)["chat_template_kwargs"]  # type: ignore[index]
    # The request's own kwargs win over the enable_thinking vLLM would derive.
    assert kwargs == {
        "enable_thinking": False,
        "reasoning_effort": "low",
        "documents": [{"title": "a", "text": "b"}],
    }
    plain = {k: v for k, v in body.items() if k != "chat_template_kwargs"}
    assert asked("chat", plain)["chat_template_kwargs"]["enable_thinking"] is True  # type: ignore[index]


def test_messages_and_responses_ask_as_the_chat_request_the_engine_makes_of_them() -> None:
    messages = {
        "model": "m",
        "system": "be brief",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert asked("messages", messages)["messages"] == [  # type: ignore[index]
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    responses = {"model": "m", "input": "hi", "instructions": "be brief"}
    assert asked("responses", responses)["messages"] == [  # type: ignore[index]
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_text_prompts_ask_with_the_special_tokens_the_route_adds() -> None:
    assert asked("completions", {"prompt": "hello"}) == {
        "model": "m",
        "prompt": "hello",
        "add_special_tokens": True,
    }
    assert asked("generate", {"text": "hi", "add_special_tokens": False}, "sglang") == {
        "model": "m",
        "prompt": "hi",
        "add_special_tokens": False,
    }


@pytest.mark.parametrize(
    ("route", "body", "engine"),
    [
        ("chat", CHAT, "sglang"),  # SGLang's /tokenize takes a prompt only
        ("chat", CHAT, None),
        ("chat", {"messages": "hi"}, "vllm"),
        ("chat", {**CHAT, "tools": [{"type": "function"}], "tool_choice": "auto"}, "vllm"),
        ("chat", {**CHAT, "chat_template_kwargs": [1]}, "vllm"),
        ("completions", {"prompt": ["a", "b"]}, "vllm"),  # a batch
        ("completions", {"prompt": "a", "add_special_tokens": "yes"}, "vllm"),
        ("messages", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "vllm"),
        ("responses", {"input": "hi", "tools": [{"type": "function"}]}, "vllm"),
    ],
)
def test_what_cannot_be_asked_exactly_is_not_asked(
    route: str, body: dict[str, object], engine: str | None
) -> None:
    with pytest.raises(NotRendered):
        tokenize_body("m", body, route, engine)


def test_an_answer_is_trusted_only_as_token_ids() -> None:
    assert read_tokens(b'{"count": 3, "max_model_len": 10, "tokens": [1, 2, 3]}') == [1, 2, 3]
    assert read_tokens(b'{"tokens": [0]}') == [0]


@pytest.mark.parametrize(
    "answer",
    [
        b"<html>",
        b"[1, 2]",
        b'{"tokens": []}',
        b'{"tokens": "123"}',
        b'{"tokens": [1, "2"]}',
        b'{"tokens": [1, true]}',
        b'{"tokens": [1, -2]}',
        b'{"tokens": [1.5]}',
        b'{"count": 4, "tokens": [1, 2, 3]}',
        b'{"count": "3", "tokens": [1, 2, 3]}',
        b'{"tokens": [' + b",".join([b"1"] * (MAX_TOKENS + 1)) + b"]}",
    ],
    ids=[
        "not-json",
        "a-list",
        "empty",
        "a-string",
        "a-string-id",
        "a-bool",
        "negative",
        "a-float",
        "wrong-count",
        "string-count",
        "too-many",
    ],
)
def test_an_answer_that_lies_is_bad(answer: bytes) -> None:
    with pytest.raises(BadTokens):
        read_tokens(answer)

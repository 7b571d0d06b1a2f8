"""The token ids `kv_aware` computes for chat bodies are the ones a real vLLM engine computes:
for each body, the router's ids (the model directory's template rendered by
`router.prompts.chat_template`, encoded by `HfTokenizer`) equal the engine's own, as its
chat endpoint reports them (`return_token_ids`) and as its `/tokenize` answers for the same
messages. Templates other than the model's come with the request (the engine trusts them
here) and are rendered by the router from the same source, so the dumps of every message
field, tools and documents are compared too. Responses and Anthropic Messages bodies are
held to the engine's count of input tokens and to `/tokenize` of the chat messages the
engine makes of them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from conformance.engines import Engine, EngineSettings
from router.prompts.chat_template import ChatTemplate, TemplateFailed
from router.prompts.tokenizer import HfTokenizer
from tests.engine.conftest import EngineHost, host_engines

MODEL = "tiny"

# Every field the router rebuilds, as JSON: any difference in a value, a key or the key
# order shows. The first gets string content (it never loops over content), the second
# parts (it does), the third names the developer role (so developer messages stay).
DUMP_STRINGS = (
    "{% for m in messages %}{{ m|tojson }}\n{% endfor %}"
    "T{{ tools|tojson }}D{{ documents|tojson }}R{{ reasoning_effort }}E{{ enable_thinking }}"
    "{% if add_generation_prompt %}GO{% endif %}"
)
DUMP_PARTS = (
    "{% for m in messages %}{{ m|tojson }}"
    "{% if m.content is not string %}{% for p in m.content %}[{{ p.type }}]{% endfor %}{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
)
DUMP_DEVELOPER = (
    "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m|tojson }}\n{% endfor %}"
)
RAISES = (
    "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    "{{ messages[0]['content'] }}"
)

TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a router."},
    {"role": "user", "content": "tell me about the router"},
    {"role": "assistant", "content": "It routes requests to engines."},
    {"role": "user", "content": "and the cache?"},
]
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "what is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris", "unit": "C"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": ""}},
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sunny"}],
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "extra": "dropped by the engine",
        },
    },
    {"type": "function", "function": {"name": "time", "strict": True}},
]

# (name, body, compare with /tokenize too): /tokenize takes messages,
# add_generation_prompt, continue_final_message, add_special_tokens,
# chat_template_kwargs, tools and chat_template, but not chat's documents and
# reasoning_effort, nor its renaming of reasoning_content.
MODEL_TEMPLATE_BODIES: list[tuple[str, dict[str, Any], bool]] = [
    ("plain", {"messages": TURNS[1:2]}, True),
    ("system, user, assistant turns", {"messages": TURNS}, True),
    (
        "content as a list of parts",
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first part"},
                        "a plain string part",
                        {"type": "text", "text": "last part"},
                    ],
                },
            ]
        },
        True,
    ),
    ("add_generation_prompt false", {"messages": TURNS, "add_generation_prompt": False}, True),
    (
        "continue_final_message",
        {
            "messages": [*TURNS[:2], {"role": "assistant", "content": "The router is"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        True,
    ),
    (
        "continue_final_message of parts",
        {
            "messages": [
                TURNS[1],
                {"role": "assistant", "content": [{"type": "text", "text": "It is a"}]},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        True,
    ),
    ("add_special_tokens true", {"messages": TURNS[1:2], "add_special_tokens": True}, True),
    (
        "developer messages become one system message",
        {
            "messages": [
                {"role": "system", "content": "System rules."},
                {"role": "user", "content": "hello"},
                {"role": "developer", "content": "Developer rules."},
                {"role": "user", "content": "again"},
            ]
        },
        True,
    ),
    ("tool calls and a tool answer", {"messages": TOOL_TURNS}, True),
    (
        "chat_template_kwargs the template reads, and one it does not",
        {"messages": TURNS[1:2], "chat_template_kwargs": {"bos_token": "<|pad|>", "unused": 1}},
        True,
    ),
    (
        "a system message's billing header line",
        {
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=1\nSystem."},
                TURNS[1],
            ]
        },
        True,
    ),
]

REQUEST_TEMPLATE_BODIES: list[tuple[str, str, dict[str, Any], bool]] = [
    ("every field, string content", DUMP_STRINGS, {"messages": TURNS}, True),
    (
        "tools, tool calls, names, reasoning",
        DUMP_STRINGS,
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "ann"},
                {**TOOL_TURNS[1], "reasoning": "the user wants weather"},
                TOOL_TURNS[2],
            ],
            "tools": TOOLS,
            "tool_choice": "none",
        },
        True,
    ),
    (
        "parts joined with newlines, an empty text part",
        DUMP_STRINGS,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "one"},
                        {"type": "text", "text": ""},
                        {"type": "text", "text": "two"},
                    ],
                }
            ]
        },
        True,
    ),
    (
        "documents, reasoning_effort, reasoning_content",
        DUMP_STRINGS,
        {
            "messages": [
                TURNS[1],
                {"role": "assistant", "content": "ok", "reasoning_content": "thinking"},
                TURNS[3],
            ],
            "documents": [{"title": "Routers", "text": "They route."}],
            "reasoning_effort": "low",
        },
        False,
    ),
    (
        "parts with fields of their own",
        DUMP_PARTS,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "cached", "cache_control": {"type": "ephemeral"}},
                        "plain",
                    ],
                },
                {"role": "assistant", "content": "fine"},
                {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r"}]},
            ]
        },
        True,
    ),
    (
        "a template that names the developer role",
        DUMP_DEVELOPER,
        {"messages": [TURNS[0], {"role": "developer", "content": "dev"}, TURNS[1]]},
        True,
    ),
    ("a raising template, one message", RAISES, {"messages": TURNS[1:2]}, True),
]

RESPONSES_BODIES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    ("input string", {"input": "tell me about the router"}, [TURNS[1]]),
    (
        "instructions and input string",
        {"instructions": "Be brief.", "input": "tell me about the router"},
        [{"role": "system", "content": "Be brief."}, TURNS[1]],
    ),
    (
        "input messages",
        {
            "input": [
                {"role": "user", "content": "tell me about the router"},
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "It routes.", "annotations": []}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "more"}],
                },
            ]
        },
        [
            TURNS[1],
            {"role": "assistant", "content": "It routes."},
            {"role": "user", "content": "more"},
        ],
    ),
]


@pytest.fixture(scope="module")
def host() -> Iterator[EngineHost]:
    settings = EngineSettings(
        served_model_name=MODEL,
        extra_args=("--max-model-len", "2048", "--trust-request-chat-template"),
    )
    yield from host_engines([settings], name="chat-tokens")


@pytest.fixture
def engine(host: EngineHost) -> Engine:
    return host.engines[0]


@pytest.fixture(scope="module")
def tokenizer(host: EngineHost) -> HfTokenizer:
    tokenizer = HfTokenizer(str(host.engines[0].environment.model_dir))
    assert tokenizer.chat is not None
    return tokenizer


async def _chat_ids(client: httpx.AsyncClient, engine: Engine, body: dict[str, Any]) -> list[int]:
    request = {"model": MODEL, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}
    response = await client.post(f"{engine.url}/v1/chat/completions", json=request)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["prompt_token_ids"]
    return ids


async def _tokenize_ids(
    client: httpx.AsyncClient, engine: Engine, body: dict[str, Any]
) -> list[int]:
    fields = (
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template_kwargs",
        "tools",
        "chat_template",
    )
    request = {"model": MODEL, **{k: body[k] for k in fields if k in body}}
    response = await client.post(f"{engine.url}/tokenize", json=request)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["tokens"]
    return ids


def _report(kind: str, compared: int, mismatches: list[str]) -> None:
    print(f"\n{kind}: {compared - len(mismatches)} of {compared} bodies identical")
    for line in mismatches:
        print(f"  MISMATCH {line}")


async def test_the_models_template_gives_the_engines_ids(
    engine: Engine, tokenizer: HfTokenizer
) -> None:
    chat_mismatches: list[str] = []
    tokenize_mismatches: list[str] = []
    tokenized = 0
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=60) as client:
            for name, body, via_tokenize in MODEL_TEMPLATE_BODIES:
                ours = tokenizer.chat_tokens(body)
                theirs = await _chat_ids(client, engine, body)
                if ours != theirs:
                    chat_mismatches.append(f"{name}: router {ours} engine {theirs}")
                if via_tokenize:
                    tokenized += 1
                    answer = await _tokenize_ids(client, engine, body)
                    if ours != answer:
                        tokenize_mismatches.append(f"{name}: router {ours} /tokenize {answer}")
    _report("model template, chat endpoint", len(MODEL_TEMPLATE_BODIES), chat_mismatches)
    _report("model template, /tokenize", tokenized, tokenize_mismatches)
    assert chat_mismatches == [] and tokenize_mismatches == []


async def test_other_templates_render_every_field_as_the_engine_does(
    engine: Engine, tokenizer: HfTokenizer
) -> None:
    assert tokenizer.chat is not None
    special = tokenizer.chat.special_tokens
    chat_mismatches: list[str] = []
    tokenize_mismatches: list[str] = []
    tokenized = 0
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=60) as client:
            for name, source, body, via_tokenize in REQUEST_TEMPLATE_BODIES:
                prompt = ChatTemplate({"default": source}, special).render(body)
                ours = tokenizer.encode(prompt.text, prompt.add_special_tokens)
                with_template = {**body, "chat_template": source}
                theirs = await _chat_ids(client, engine, with_template)
                if ours != theirs:
                    chat_mismatches.append(f"{name}: router {prompt.text!r} {ours} engine {theirs}")
                if via_tokenize:
                    tokenized += 1
                    answer = await _tokenize_ids(client, engine, with_template)
                    if ours != answer:
                        tokenize_mismatches.append(f"{name}: router {ours} /tokenize {answer}")
    _report("request templates, chat endpoint", len(REQUEST_TEMPLATE_BODIES), chat_mismatches)
    _report("request templates, /tokenize", tokenized, tokenize_mismatches)
    assert chat_mismatches == [] and tokenize_mismatches == []


async def test_a_template_that_raises_fails_on_both_sides(
    engine: Engine, tokenizer: HfTokenizer
) -> None:
    assert tokenizer.chat is not None
    body = {"messages": TURNS}
    with pytest.raises(TemplateFailed, match="one message only"):
        ChatTemplate({"default": RAISES}, tokenizer.chat.special_tokens).render(body)
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=60) as client:
            request = {"model": MODEL, "max_tokens": 1, **body, "chat_template": RAISES}
            response = await client.post(f"{engine.url}/v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    assert "one message only" in response.text


async def test_responses_bodies_are_counted_and_tokenized_as_the_engine_does(
    engine: Engine, tokenizer: HfTokenizer
) -> None:
    mismatches: list[str] = []
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=60) as client:
            for name, body, messages in RESPONSES_BODIES:
                ours = tokenizer.chat_tokens(body)
                request = {"model": MODEL, "max_output_tokens": 1, "temperature": 0, **body}
                response = await client.post(f"{engine.url}/v1/responses", json=request)
                assert response.status_code == 200, response.text
                counted = response.json()["usage"]["input_tokens"]
                # The same messages through /tokenize, with the special tokens Responses adds.
                tokenize = {"messages": messages, "add_special_tokens": True}
                answer = await _tokenize_ids(client, engine, tokenize)
                if len(ours) != counted or ours != answer:
                    mismatches.append(f"{name}: router {ours} counted {counted} /tokenize {answer}")
    _report("responses, input_tokens and /tokenize", len(RESPONSES_BODIES), mismatches)
    assert mismatches == []


# (name, Messages body, the chat messages vLLM makes of it)
MESSAGES_BODIES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    (
        "a system string and one turn",
        {"system": "You are a router.", "messages": [TURNS[1]]},
        TURNS[:2],
    ),
    (
        "system blocks with a billing header, turns of text blocks",
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=5"},
                {"type": "text", "text": "Be brief."},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first part"},
                        {"type": "text", "text": "second part"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "It routes."}]},
                {"role": "user", "content": "and the cache?"},
            ],
        },
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first part"},
                    {"type": "text", "text": "second part"},
                ],
            },
            {"role": "assistant", "content": "It routes."},
            {"role": "user", "content": "and the cache?"},
        ],
    ),
    (
        "a user message without text left out",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": ""}]},
                {"role": "user", "content": "hello"},
            ]
        },
        [{"role": "user", "content": "hello"}],
    ),
]


async def test_messages_bodies_are_counted_and_tokenized_as_the_engine_does(
    engine: Engine, tokenizer: HfTokenizer
) -> None:
    mismatches: list[str] = []
    with trio.fail_after(300):
        async with httpx.AsyncClient(timeout=60) as client:
            for name, body, chat in MESSAGES_BODIES:
                ours = tokenizer.chat_tokens(body, anthropic=True)
                request = {"model": MODEL, "max_tokens": 1, "temperature": 0, **body}
                response = await client.post(f"{engine.url}/v1/messages", json=request)
                assert response.status_code == 200, response.text
                counted = response.json()["usage"]["input_tokens"]
                answer = await _tokenize_ids(client, engine, {"messages": chat})
                if len(ours) != counted or ours != answer:
                    mismatches.append(f"{name}: router {ours} counted {counted} /tokenize {answer}")
    _report("messages, input_tokens and /tokenize", len(MESSAGES_BODIES), mismatches)
    assert mismatches == []

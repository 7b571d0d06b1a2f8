"""Chat bodies rendered with the model's template as vLLM renders them, then encoded as vLLM
encodes them: the ids `kv_aware` predicts with are `tokenizer.encode(rendered,
add_special_tokens=False)` of the prompt the engine renders; what the router does not
render, or a template that fails, is no prediction counted by its reason, never a crash.
(tests/engine/test_chat_tokens.py holds the same against a real engine.)"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from conformance.tiny_model import BOS, EOS
from router.engines.kv_events import BlockStored
from router.engines.kv_events.fleet_views import KvIndexes
from router.fleet.records import Role, WorkerRecord
from router.fleet.registry import Worker
from router.policies.kv_aware import (
    CHAT,
    TEMPLATE_ERROR,
    KvAware,
    KvAwareSettings,
    request_tokens,
    tokens_or_reason,
)
from router.policies.policy import PolicyKey
from router.prompts.chat_request import NotRendered
from router.prompts.chat_template import ChatTemplate, RenderLimits, TemplateFailed
from router.prompts.tokenizer import HfTokenizer
from tests.support.model_dir import TEMPLATE, build_tokenizer, write_model

MODEL = "m"
BS = 4
# One that never loops over a message's content: vLLM hands it strings.
STRING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SYSTEM_USER = [
    {"role": "system", "content": "you are a router"},
    {"role": "user", "content": "tell me about the cache"},
]
RENDERED = (
    f"{BOS}<|system|>\nyou are a router{EOS}\n<|user|>\ntell me about the cache{EOS}\n"
    "<|assistant|>\n"
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


@pytest.fixture
def tokenizer(model_dir: Path) -> HfTokenizer:
    return HfTokenizer(str(model_dir))


def encoded(text: str, add_special_tokens: bool = False) -> list[int]:
    ids: list[int] = build_tokenizer().encode(text, add_special_tokens=add_special_tokens).ids
    return ids


def rendered(body: dict[str, Any], template: str = TEMPLATE, **tokens: str) -> str:
    special = {"bos_token": BOS, "eos_token": EOS, **tokens}
    return ChatTemplate({"default": template}, special).render(body).text


def test_a_chat_body_gets_the_ids_of_its_rendered_prompt_without_special_tokens_added(
    tokenizer: HfTokenizer,
) -> None:
    ids = request_tokens({"model": MODEL, "messages": SYSTEM_USER}, tokenizer)
    assert ids == encoded(RENDERED)
    # The template writes its own BOS; the tokenizer's would be a second one.
    assert ids is not None and ids.count(encoded(BOS)[0]) == 1
    with_specials = request_tokens({"messages": SYSTEM_USER, "add_special_tokens": True}, tokenizer)
    assert with_specials == encoded(RENDERED, add_special_tokens=True) != ids


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(
    tokenizer: HfTokenizer,
) -> None:
    body = {"messages": SYSTEM_USER, "add_generation_prompt": False}
    ids = request_tokens(body, tokenizer)
    assert ids == encoded(RENDERED.removesuffix("<|assistant|>\n"))
    assert ids != request_tokens({"messages": SYSTEM_USER}, tokenizer)


def test_content_parts_are_parts_for_a_template_that_loops_over_them_else_joined() -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first part"},
                    "hello world",
                    {"type": "text", "text": "last part"},
                    {"type": "text", "text": None},  # skipped, as vLLM skips it
                ],
            }
        ]
    }
    # TEMPLATE loops over the parts: each reaches it as a text part, concatenated.
    assert rendered(body) == f"{BOS}<|user|>\nfirst parthello worldlast part{EOS}\n<|assistant|>\n"
    # STRING_TEMPLATE does not: vLLM joins the text parts with newlines.
    assert rendered(body, STRING_TEMPLATE) == (
        f"{BOS}<|user|>\nfirst part\nhello world\nlast part{EOS}\n<|assistant|>\n"
    )
    # An empty part is dropped from the join (vLLM keeps only what parses to something).
    empty = {
        "messages": [
            {"role": "user", "content": ["hello", {"type": "text", "text": ""}, "", "world"]}
        ]
    }
    assert rendered(empty, STRING_TEMPLATE) == f"{BOS}<|user|>\nhello\nworld{EOS}\n<|assistant|>\n"
    # A string content reaches a part-looping template as one text part.
    assert rendered({"messages": [{"role": "user", "content": "hello"}]}) == (
        f"{BOS}<|user|>\nhello{EOS}\n<|assistant|>\n"
    )


def test_continue_final_message_ends_the_prompt_inside_the_final_message() -> None:
    body = {
        "messages": [*SYSTEM_USER, {"role": "assistant", "content": "it is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert rendered(body) == RENDERED + "it is"
    parts = {
        **body,
        "messages": [
            *SYSTEM_USER,
            {"role": "assistant", "content": [{"type": "text", "text": "it is"}]},
        ],
    }
    assert rendered(parts) == RENDERED + "it is"
    with pytest.raises(NotRendered):  # the engine refuses both at once
        rendered({**body, "add_generation_prompt": True})


def setup_policy(tokenizer: HfTokenizer, *loads: int) -> tuple[KvAware, KvIndexes, list[Worker]]:
    indexes = KvIndexes()
    fleet = [
        Worker(
            record=WorkerRecord(id=f"w{i}", url=f"http://w{i}.test:8000", models=(MODEL,)),
            inflight=load,
        )
        for i, load in enumerate(loads)
    ]
    for worker in fleet:
        indexes.for_model(MODEL).apply_cleared((worker.id, None))
    policy = KvAware(KvAwareSettings(), indexes, lambda: 0.0, tokenizer)
    return policy, indexes, fleet


def store(indexes: KvIndexes, worker: str, ids: list[int]) -> None:
    count = len(ids) // BS
    block = BlockStored(list(range(1000, 1000 + count)), None, ids[: count * BS], BS)
    indexes.for_model(MODEL).apply((worker, None), [block])


def test_a_chat_request_goes_to_the_worker_holding_its_rendered_prompt(
    tokenizer: HfTokenizer,
) -> None:
    policy, indexes, fleet = setup_policy(tokenizer, 0, 1)
    store(indexes, "w1", encoded(RENDERED))
    chat = PolicyKey(MODEL, Role.MIXED, body={"model": MODEL, "messages": SYSTEM_USER})
    assert policy.pick(chat, fleet).id == "w1"
    stats = policy.statistics()
    assert stats["picks_by_match"] == 1 and stats["no_prediction_chat_template"] == 0


def test_a_template_that_raises_is_no_prediction_counted_as_template_error(
    tmp_path: Path,
) -> None:
    raising = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    tokenizer = HfTokenizer(str(write_model(tmp_path / "model", raising + TEMPLATE)))
    policy, indexes, fleet = setup_policy(tokenizer, 1, 0)
    store(indexes, "w0", encoded(RENDERED))
    chat = PolicyKey(MODEL, Role.MIXED, body={"messages": SYSTEM_USER})
    assert policy.pick(chat, fleet).id == "w1"  # by load
    one = PolicyKey(MODEL, Role.MIXED, body={"messages": SYSTEM_USER[1:]})
    policy.pick(one, fleet)
    stats = policy.statistics()
    assert stats["no_prediction_template_error"] == 1
    assert stats["predictions"] == 1


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": 7}]},
        {"messages": [{"role": "user", "content": {"text": "hi"}}]},
        {"messages": [{"role": "user", "content": [[[["deep"]]]]}]},
        {"messages": [{"role": 3, "content": "hi"}]},
        {"messages": ["hi"]},
        {"messages": "hi"},
        {"messages": []},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"role": "user", "content": "hi", "name": 5}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": 1}]}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]},
        {"messages": SYSTEM_USER, "add_generation_prompt": "yes"},
        {"messages": SYSTEM_USER, "chat_template_kwargs": ["not", "an", "object"]},
        {"messages": SYSTEM_USER, "chat_template_kwargs": {"tokenize": True}},
        {"messages": SYSTEM_USER, "chat_template": "{{ messages }}"},
        {"messages": SYSTEM_USER, "tools": [{"type": "function", "function": {"name": 5}}]},
        {"messages": SYSTEM_USER, "tools": []},
        {"messages": SYSTEM_USER, "truncate_prompt_tokens": 10},
        {"messages": SYSTEM_USER, "reasoning_effort": "extreme"},
        # Anthropic Messages: vLLM converts them after probing the template.
        {"system": "you are a router", "messages": SYSTEM_USER[1:], "max_tokens": 5},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        {"input": "hi", "previous_response_id": "resp_1"},
        {"input": 5},
    ],
)
def test_bodies_the_router_does_not_render_are_no_prediction_never_an_error(
    tokenizer: HfTokenizer, body: dict[str, Any]
) -> None:
    assert tokens_or_reason(body, tokenizer) == CHAT


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "tool_calls", "name", "x"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=30,
)


class InMemoryTokenizer:
    """`HfTokenizer`'s chat path without files (Hypothesis takes no tmp_path)."""

    def __init__(self) -> None:
        self.model = build_tokenizer()
        self.chat = ChatTemplate({"default": TEMPLATE}, {"bos_token": BOS, "eos_token": EOS})

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.model.encode(text).ids
        return ids

    def chat_tokens(self, body: Mapping[str, Any], anthropic: bool = False) -> list[int]:
        prompt = self.chat.render(body, anthropic=anthropic)
        ids: list[int] = self.model.encode(
            prompt.text, add_special_tokens=prompt.add_special_tokens
        ).ids
        return ids


IN_MEMORY = InMemoryTokenizer()


@settings(max_examples=300, deadline=None)
@given(
    messages=json_values,
    extra=st.dictionaries(
        st.sampled_from(
            [
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "chat_template_kwargs",
                "tools",
                "documents",
                "reasoning_effort",
                "instructions",
                "truncation",
                "kv_transfer_params",
                "system",
                "thinking",
                "other",
            ]
        ),
        json_values,
        max_size=4,
    ),
)
def test_any_json_for_messages_is_ids_or_a_reason(messages: Any, extra: dict[str, Any]) -> None:
    for body, route in (
        ({**extra, "messages": messages}, "chat"),
        ({**extra, "input": messages}, "responses"),
        ({**extra, "messages": messages}, "messages"),
    ):
        found = tokens_or_reason(body, IN_MEMORY, route)
        assert isinstance(found, str) or all(isinstance(i, int) for i in found)


def test_huge_content_renders_and_a_quadratic_template_runs_out_of_budget() -> None:
    big = {"messages": [{"role": "user", "content": "hello " * 200_000}]}
    assert len(rendered(big)) > 1_200_000
    quadratic = (
        "{% for m in messages %}{% for other in messages %}{{ other.role[0] }}"
        "{% endfor %}{% endfor %}"
    )
    many = {"messages": [{"role": "user", "content": "x"}] * 300}
    template = ChatTemplate({"default": quadratic}, {}, RenderLimits(operations=10_000))
    with pytest.raises(TemplateFailed, match="budget"):
        template.render(many)
    # Rebuilding the messages spends the budget too: a flood of tiny ones stops at once.
    flood = ChatTemplate({"default": "{{ 1 }}"}, {}, RenderLimits(operations=1_000))
    with pytest.raises(TemplateFailed, match="budget"):
        flood.render({"messages": [{"role": "user", "content": ["x", "y"]}] * 400})
    # the same template on a short conversation is within it
    assert template.render({"messages": many["messages"][:10]}).text == "u" * 100
    long = ChatTemplate(
        {"default": "{{ messages[0].content * 5 }}"}, {}, RenderLimits(output_chars=100)
    )
    with pytest.raises(TemplateFailed, match="length"):
        long.render({"messages": [{"role": "user", "content": "x" * 30}]})


def test_the_sandbox_keeps_the_template_off_python_and_the_request() -> None:
    for source in (
        "{{ messages.append(1) }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ undefined_function() }}",
        "{{ messages[0].content + 1 }}",
    ):
        with pytest.raises(TemplateFailed):
            ChatTemplate({"default": source}, {}).render({"messages": SYSTEM_USER})


def test_a_template_that_does_not_parse_is_refused_when_loaded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not parse"):
        HfTokenizer(str(write_model(tmp_path / "model", "{% for m in messages %}")))


def test_a_model_dir_without_a_template_predicts_text_but_not_chat(tmp_path: Path) -> None:
    directory = write_model(tmp_path / "model", template=None)
    tokenizer = HfTokenizer(str(directory))
    assert tokenizer.chat is None
    file_only = HfTokenizer(str(directory / "tokenizer.json"))
    text = {"prompt": "tell me about the cache"}
    assert request_tokens(text, tokenizer) == request_tokens(text, file_only)
    assert request_tokens(text, tokenizer) == encoded("tell me about the cache", True)
    assert tokens_or_reason({"messages": SYSTEM_USER}, tokenizer) == CHAT
    assert tokens_or_reason({"messages": SYSTEM_USER}, file_only) == CHAT


def test_a_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load"):
        HfTokenizer(str(tmp_path))


def test_chat_template_jinja_comes_before_the_configs_and_tool_use_serves_tools(
    tmp_path: Path,
) -> None:
    directory = write_model(tmp_path / "model", "config {{ messages[0].content }}", jinja="file")
    template = ChatTemplate.from_model_dir(directory)
    assert template is not None
    assert template.render({"messages": SYSTEM_USER}).text == "file"
    named = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools {{ tools[0].function.name }}"},
    ]
    template = ChatTemplate.from_model_dir(write_model(tmp_path / "named", named))
    assert template is not None
    assert template.render({"messages": SYSTEM_USER}).text == "plain"
    tools = [{"type": "function", "function": {"name": "weather"}}]
    assert template.render({"messages": SYSTEM_USER, "tools": tools}).text == "tools weather"


def test_models_vllm_renders_otherwise_are_not_rendered(tmp_path: Path) -> None:
    gpt_oss = write_model(tmp_path / "gpt")
    (gpt_oss / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    mistral = write_model(tmp_path / "mistral")
    (mistral / "consolidated.safetensors").write_text("")
    (mistral / "tekken.json").write_text("{}")
    processor = write_model(tmp_path / "processor")
    (processor / "chat_template.json").write_text(json.dumps({"chat_template": "x"}))
    for directory in (gpt_oss, mistral, processor, tmp_path / "no-config"):
        assert ChatTemplate.from_model_dir(directory) is None


def test_special_tokens_and_the_kwargs_the_template_reads(tmp_path: Path) -> None:
    source = "{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ flavour }}"
    directory = write_model(
        tmp_path / "model",
        source,
        eos_token={"__type": "AddedToken", "content": "</end>", "special": True},
        image_token="<image>",
        add_bos_token=True,
    )
    template = ChatTemplate.from_model_dir(directory)
    assert template is not None
    body: dict[str, Any] = {"messages": SYSTEM_USER}
    assert template.render(body).text == f"{BOS}|</end>|<image>|"
    kwargs = {"flavour": "mint", "bos_token": "<b>", "eos_token": None}
    body["chat_template_kwargs"] = kwargs
    # The request's variables are passed, over the special tokens; a None is not.
    assert template.render(body).text == "<b>|</end>|<image>|mint"


def test_developer_messages_become_system_ones_unless_the_template_names_the_role() -> None:
    body = {
        "messages": [
            SYSTEM_USER[0],
            {"role": "user", "content": "hello"},
            {"role": "developer", "content": "be brief"},
        ]
    }
    assert rendered(body, STRING_TEMPLATE) == (
        f"{BOS}<|system|>\nyou are a router\n\nbe brief{EOS}\n<|user|>\nhello{EOS}\n<|assistant|>\n"
    )
    naming = (
        "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{{ m.role }};{% endfor %}"
    )
    assert rendered(body, naming) == "system;user;Ddeveloper;"


def test_message_fields_reach_the_template_as_vllm_hands_them() -> None:
    dump = "{% for m in messages %}{{ m|tojson }}\n{% endfor %}{{ tools|tojson }}"
    body = {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=9\nrules", "extra": 1},
            {"role": "user", "content": "hi", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "because",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'},
                        "id": "c1",
                    },
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object"}, "extra": 1},
                "defer_loading": True,
            }
        ],
    }
    lines = rendered(body, dump).split("\n")
    assert [json.loads(line) for line in lines[:4]] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "function": {"arguments": {"b": 1, "a": 2}, "name": "f"},
                    "type": "function",
                },
                {"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"},
            ],
            "reasoning": "because",
            "reasoning_content": "because",
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
    ]
    # Key order too: templates that dump a message show it.
    assert lines[2].startswith(
        '{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"arguments"'
    )
    assert json.loads(lines[4]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": None,
                "parameters": {"type": "object"},
                "defer_loading": True,
            },
            "defer_loading": True,
        }
    ]


def test_responses_input_is_rendered_with_special_tokens_added(tokenizer: HfTokenizer) -> None:
    body = {"instructions": "you are a router", "input": "tell me about the cache"}
    assert request_tokens(body, tokenizer) == encoded(RENDERED, add_special_tokens=True)
    items = {
        "instructions": "you are a router",
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "tell me about the cache"}],
            }
        ],
    }
    assert request_tokens(items, tokenizer) == encoded(RENDERED, add_special_tokens=True)
    unfinished = {
        "input": [
            *SYSTEM_USER,
            {"role": "assistant", "content": "it is", "status": "incomplete"},
        ]
    }
    assert request_tokens(unfinished, tokenizer) == encoded(RENDERED + "it is", True)


@pytest.mark.parametrize(
    ("source", "parts"),
    [
        (TEMPLATE, True),
        (STRING_TEMPLATE, False),
        (
            "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
            True,
        ),
        (
            "{% set msgs = messages|selectattr('role') %}{% for m in msgs %}"
            "{% for c in m['content']|list %}{% endfor %}{% endfor %}",
            True,
        ),
        (
            "{% macro show(items) %}{% for i in items %}{{ i.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            True,
        ),
        ("{% set content = messages[0].content %}{% for c in content %}{% endfor %}", True),
        ("{% for m in messages %}{% for c in m.other %}{% endfor %}{% endfor %}", False),
        ("{% for m, n in messages %}{% endfor %}", False),
    ],
)
def test_the_content_format_is_detected_from_the_template_as_vllm_does(
    source: str, parts: bool
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    probe = source + "{% for m in messages %}{{ '|' ~ (m.content is string) }}{% endfor %}"
    assert rendered(body, probe).endswith("|False" if parts else "|True")


def test_the_reasons_are_the_policys(tmp_path: Path) -> None:
    raising = "{{ raise_exception('no') }}"
    tokenizer = HfTokenizer(str(write_model(tmp_path / "model", raising)))
    assert tokens_or_reason({"messages": SYSTEM_USER}, tokenizer) == TEMPLATE_ERROR
    assert tokens_or_reason({"messages": SYSTEM_USER}, None) == CHAT


def test_a_message_of_many_tool_calls_spends_the_budget_before_it_is_rebuilt() -> None:
    from router.prompts.chat_template import DEFAULT_OPERATIONS

    template = ChatTemplate({"default": TEMPLATE}, {"bos_token": BOS, "eos_token": EOS})
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call] * (DEFAULT_OPERATIONS + 1)},
        ]
    }
    with pytest.raises(TemplateFailed, match="tool calls than the operation budget"):
        template.render(body)

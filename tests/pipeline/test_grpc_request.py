"""A body as the gRPC engine's `GenerateRequest`: sampling fields mapped as vLLM's servers
map them, its defaults, and the gap named before any worker is picked."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from router.api.errors import BadRequest
from router.pipeline.grpc_request import build_generate, grpc_gap
from router.pipeline.resolve import GenerationRequest, parse_generation_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def request(path: str, **body: Any) -> GenerationRequest:
    return parse_generation_request(path, orjson.dumps(body), ["m"])


def built(path: str, **body: Any) -> pb.GenerateRequest:
    generation = request(path, **body)
    out = build_generate(pb, generation, [5, 6], "rid", frozenset({1}), None)
    return pb.GenerateRequest.FromString(out.request)


def test_chat_sampling_fields_map_onto_the_engines_params() -> None:
    sent = built(
        "/v1/chat/completions",
        **CHAT,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        max_completion_tokens=9,
        stop=["a", ""],
        stop_token_ids=[7],
        seed=3,
        n=2,
        logit_bias={"5": -100},
        stream=True,
    )
    params = sent.sampling_params
    assert (sent.request_id, list(sent.tokenized.input_ids), sent.stream) == ("rid", [5, 6], True)
    assert params.HasField("temperature") and params.temperature == 0
    assert (params.top_p, params.top_k, params.max_tokens) == (0.5, 0, 9)
    assert (list(params.stop), list(params.stop_token_ids), params.seed) == (["a"], [7], 3)
    assert (params.n, dict(params.logit_bias)) == (2, {5: -100.0})
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not sent.HasField("data_parallel_rank")


@pytest.mark.parametrize(
    ("path", "body", "count"),
    [
        ("/v1/chat/completions", {**CHAT}, None),
        ("/v1/chat/completions", {**CHAT, "logprobs": False}, None),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, 0),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, 3),
        ("/v1/completions", {"model": "m", "prompt": "x"}, None),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 0}, 0),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 5}, 5),
    ],
)
def test_logprobs_are_asked_of_the_engine_as_vllms_servers_ask(
    path: str, body: dict[str, Any], count: int | None
) -> None:
    generation = request(path, **body)
    out = build_generate(pb, generation, [5, 6], "rid", frozenset({1}), None)
    params = pb.GenerateRequest.FromString(out.request).sampling_params
    assert out.logprobs == count
    assert params.HasField("logprobs") == (count is not None)
    assert params.logprobs == (count or 0)


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "`logprobs` must be set to true"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "non-negative"),
        ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "must be a boolean"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": -1}, "non-negative"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": True}, "an integer"),
    ],
)
def test_a_logprobs_field_the_servers_refuse_is_the_clients_400(
    path: str, body: dict[str, Any], why: str
) -> None:
    with pytest.raises(BadRequest, match=why):
        build_generate(pb, request(path, **body), [5, 6], "rid", frozenset({1}), None)


def test_the_servers_defaults_chat_to_the_context_completions_to_16() -> None:
    assert not built("/v1/chat/completions", **CHAT).sampling_params.HasField("max_tokens")
    assert not built("/v1/chat/completions", **CHAT).sampling_params.HasField("temperature")
    assert built("/v1/completions", model="m", prompt="x").sampling_params.max_tokens == 16


def test_messages_and_responses_take_their_own_limits_and_stops() -> None:
    messages = built(
        "/v1/messages", **CHAT, max_tokens=7, stop_sequences=["END"], top_k=4
    ).sampling_params
    assert (messages.max_tokens, list(messages.stop), messages.top_k) == (7, ["END"], 4)
    responses = built("/v1/responses", model="m", input="hi", max_output_tokens=5)
    assert responses.sampling_params.max_tokens == 5


def test_generate_reads_sglangs_sampling_params() -> None:
    sent = built(
        "/generate",
        model="m",
        text="x",
        sampling_params={"max_new_tokens": 3, "min_new_tokens": 1, "stop": ["z"], "top_k": 2},
    ).sampling_params
    assert (sent.max_tokens, sent.min_tokens, list(sent.stop), sent.top_k) == (3, 1, ["z"], 2)
    assert built("/generate", model="m", input_ids=[1]).sampling_params.max_tokens == 128


def test_stop_ids_are_the_requests_and_the_models_unless_eos_is_ignored() -> None:
    generation = request("/v1/completions", model="m", prompt="x", stop_token_ids=[9])
    assert build_generate(pb, generation, [5], "r", frozenset({1}), 0).stop_ids == {1, 9}
    ignoring = request("/v1/completions", model="m", prompt="x", ignore_eos=True)
    assert build_generate(pb, ignoring, [5], "r", frozenset({1}), 0).stop_ids == frozenset()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"stop": 5}, "'stop' must be"),
        ({"seed": "x"}, "'seed' must be"),
        ({"ignore_eos": 1}, "must be a boolean"),
    ],
)
def test_a_field_of_the_wrong_type_is_the_clients_400(body: dict[str, Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        built("/v1/completions", model="m", prompt="x", **body)


@pytest.mark.parametrize(
    ("path", "body", "gap"),
    [
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tool calls"),
        ("/v1/chat/completions", {**CHAT, "tools": [{}], "tool_choice": "none"}, None),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, None),
        ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": 0}, None),
        ("/v1/completions", {"model": "m", "prompt": "a", "prompt_logprobs": 1}, "prompt logprobs"),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 0}, "prompt logprobs"),
        ("/v1/responses", {"model": "m", "input": "x", "top_logprobs": 2}, "logprobs"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}},
            "structured output",
        ),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, None),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
            "a `image_url` content part",
        ),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, "batched prompts"),
        ("/v1/completions", {"model": "m", "prompt": "a", "echo": True}, "`echo`"),
        ("/v1/completions", {"model": "m", "prompt": [1, 2]}, None),
        ("/v1/responses", {"model": "m", "input": "x", "previous_response_id": "r"}, "previous"),
        ("/v1/messages", {**CHAT, "max_tokens": 3, "thinking": {"type": "enabled"}}, "thinking"),
        ("/generate", {"model": "m", "text": "x"}, None),
        ("/generate", {"model": "m", "text": "x", "return_logprob": True}, "`return_logprob`"),
        ("/generate", {"model": "m", "text": ["x", "y"]}, "batched prompts"),
        ("/v1/embeddings", {"model": "m", "input": "x"}, "the /v1/embeddings route"),
    ],
)
def test_the_gap_is_named(path: str, body: dict[str, Any], gap: str | None) -> None:
    found = grpc_gap(request(path, **body))
    if gap is None:
        assert found is None
    else:
        assert found is not None and gap in found

"""The fake engine's newer APIs as data: Responses and Anthropic events, and the
non-generation answers in each engine's format."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from router.fake_worker.apis import paced_events, parse_request, render_unary, stream_frames
from router.fake_worker.behaviour import Behaviour
from router.fake_worker.formats import Api, BadGenerationRequest, expected_text
from router.fake_worker.pooling import (
    PoolingContext,
    embeddings,
    rerank,
    score,
    similarity,
    tokenize,
    vector,
)
from router.fake_worker.stats import RankLoad


def events(api: Api, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    gen = parse_request(api, {**body, "stream": True}, 16, "m")
    out = []
    for raw in paced_events(stream_frames(gen, "x-1", 0), Behaviour(), RankLoad()):
        assert isinstance(raw, bytes) and raw.endswith(b"\n\n")
        name, data = raw.rstrip(b"\n").split(b"\n")
        out.append(
            (name.removeprefix(b"event: ").decode(), orjson.loads(data.removeprefix(b"data: ")))
        )
    return out


def test_anthropic_stream_is_the_messages_event_sequence_with_honest_usage() -> None:
    seen = events(
        Api.MESSAGES,
        {
            "max_tokens": 3,
            "system": [{"type": "text", "text": "a b"}],
            "messages": [{"role": "user", "content": "c d e"}],
        },
    )
    assert [name for name, _ in seen] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in seen)
    assert seen[0][1]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert "".join(
        data["delta"]["text"] for name, data in seen if name == "content_block_delta"
    ) == expected_text(3)
    assert seen[-2][1]["usage"] == {"output_tokens": 3}
    assert seen[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_anthropic_requires_max_tokens_like_the_real_api() -> None:
    with pytest.raises(BadGenerationRequest, match="max_tokens"):
        parse_request(Api.MESSAGES, {"messages": [{"role": "user", "content": "x"}]}, 16, "m")
    with pytest.raises(BadGenerationRequest, match="role"):
        parse_request(
            Api.MESSAGES,
            {"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]},
            16,
            "m",
        )


def test_responses_stream_numbers_every_event_and_ends_with_the_whole_response() -> None:
    seen = events(
        Api.RESPONSES,
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "one two"}]}],
            "instructions": "three",
        },
    )
    assert [data["sequence_number"] for _, data in seen] == list(range(len(seen)))
    assert [name for name, _ in seen][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = seen[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["output_tokens"] == 16
    assert final["output"][0]["content"][0]["text"] == expected_text(16)
    unary = orjson.loads(
        render_unary(parse_request(Api.RESPONSES, {"input": "x y"}, 16, "m"), "resp_fake-1", 0)
    )
    assert unary["status"] == "completed" and unary["usage"]["total_tokens"] == 18
    assert unary["output"][0]["id"] == "msg_fake-1"


def ctx(engine: str = "sglang", dim: int = 16) -> PoolingContext:
    return PoolingContext(model="m", engine=engine, embedding_dim=dim, request_id="1", created=0)


def test_vectors_are_unit_length_deterministic_and_input_dependent() -> None:
    a, b = vector("same", 40), vector("other", 40)
    assert len(a) == 40 and a == vector("same", 40) and a != b
    assert math.isclose(math.fsum(v * v for v in a), 1.0, abs_tol=1e-4)
    answer = embeddings({"input": [[1, 2], [1, 2], [3]]}, ctx(dim=8))
    assert (
        answer["data"][0]["embedding"]
        == answer["data"][1]["embedding"]
        != answer["data"][2]["embedding"]
    )
    assert answer["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    with pytest.raises(BadGenerationRequest, match="dimensions"):
        embeddings({"input": "x", "dimensions": 9}, ctx(dim=8))


def test_rerank_in_each_engines_format_best_first() -> None:
    body = {"query": "q", "documents": ["a", "b", "c"], "top_n": 2}
    scores = {doc: similarity("q", doc) for doc in "abc"}
    best = sorted(scores, key=lambda doc: -scores[doc])[:2]
    sglang = rerank(body, ctx("sglang"))
    assert [item["document"] for item in sglang] == best
    assert [item["score"] for item in sglang] == [scores[doc] for doc in best]
    vllm = rerank(body, ctx("vllm"))
    assert [item["document"]["text"] for item in vllm["results"]] == best
    assert vllm["usage"] == {"total_tokens": 6}


def test_score_and_tokenize_in_each_engines_format() -> None:
    sglang = score({"query": "q", "items": ["a", "b"], "label_token_ids": [1, 2, 3]}, ctx("sglang"))
    assert [len(row) for row in sglang["scores"]] == [3, 3]
    vllm = score({"text_1": "q", "text_2": ["a", "b"]}, ctx("vllm"))
    assert [item["score"] for item in vllm["data"]] == [similarity("q", "a"), similarity("q", "b")]
    with pytest.raises(BadGenerationRequest, match="same length"):
        score({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, ctx("vllm"))
    assert tokenize({"prompt": "a b a"}, ctx())["count"] == 3
    ids = tokenize({"prompt": "a b a"}, ctx())["tokens"]
    assert ids[0] == ids[2] != ids[1]

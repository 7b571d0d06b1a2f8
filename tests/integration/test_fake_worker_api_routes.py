"""The fake worker's routes beyond chat over real loopback sockets: scripted failures apply
to every one, errors come in each API's shape, answers in each engine's format."""

from __future__ import annotations

import httpx
import pytest
import trio

from router.fake_worker.behaviour import FailMode
from router.fake_worker.cli import parse_settings
from router.fake_worker.settings import FakeWorkerSettings
from tests.support.fake_fleet import open_fake_fleet

GUARD_S = 20
BODIES = {
    "/v1/embeddings": {"input": "x"},
    "/v1/rerank": {"query": "q", "documents": ["a"]},
    "/v1/score": {"query": "q", "items": ["a"], "label_token_ids": [1]},
    "/v1/classify": {"input": "x"},
    "/v1/tokenize": {"prompt": "x"},
    "/v1/detokenize": {"tokens": [1]},
    "/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [1]},
    "/pooling": {"input": "x"},
    "/v1/responses": {"input": "x"},
    "/v1/messages": {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
}


async def test_fail_first_applies_to_every_route_and_counts_each_as_a_dispatch() -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(
            [FakeWorkerSettings(fail_first=len(BODIES), fail_status=503)]
        ) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                failed = {path: await client.post(path, json=body) for path, body in BODIES.items()}
                served = {
                    path: (await client.post(path, json=body)).status_code
                    for path, body in BODIES.items()
                }
            routing = fleet[0].worker.routing
    assert {path: r.status_code for path, r in failed.items()} == dict.fromkeys(BODIES, 503)
    assert all(r.headers["retry-after"] == "1" for r in failed.values())
    assert failed["/v1/messages"].json()["type"] == "error"
    assert failed["/v1/messages"].json()["error"]["type"] == "api_error"
    assert failed["/v1/embeddings"].json()["error"]["code"] == 503
    assert served == dict.fromkeys(BODIES, 200)
    assert (routing.dispatches, routing.failures) == (2 * len(BODIES), len(BODIES))


@pytest.mark.parametrize("mode", [FailMode.MIDSTREAM, FailMode.GARBAGE])
async def test_a_broken_embeddings_answer_is_not_json(mode: FailMode) -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([FakeWorkerSettings(fail_first=1, fail_mode=mode)]) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                if mode is FailMode.MIDSTREAM:
                    with pytest.raises(httpx.RemoteProtocolError):
                        await client.post("/v1/embeddings", json={"input": "x"})
                else:
                    garbage = await client.post("/v1/embeddings", json={"input": "x"})
                    assert garbage.status_code == 200
                    with pytest.raises(ValueError):
                        garbage.json()
                after = await client.post("/v1/embeddings", json={"input": "x"})
    assert after.status_code == 200 and len(after.json()["data"][0]["embedding"]) == 16


async def test_bad_input_is_a_400_in_the_routes_own_shape() -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet(1) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                messages = await client.post(
                    "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}
                )
                embeddings = await client.post("/v1/embeddings", json={"input": 5})
                not_json = await client.post("/v1/rerank", content=b"{")
    assert messages.status_code == embeddings.status_code == not_json.status_code == 400
    assert (
        messages.json()["type"] == "error"
        and messages.json()["error"]["type"] == "invalid_request_error"
    )
    assert "max_tokens" in messages.json()["error"]["message"]
    assert embeddings.json()["error"]["type"] == "invalid_request_error"
    assert not_json.json()["error"]["message"] == "the request body must be a JSON object"


async def test_vllm_formats_for_rerank_score_and_detokenize() -> None:
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([FakeWorkerSettings(engine="vllm")]) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                rerank = (
                    await client.post("/v1/rerank", json={"query": "q", "documents": ["a", "b"]})
                ).json()
                score = (
                    await client.post("/v1/score", json={"text_1": "q", "text_2": ["a", "b"]})
                ).json()
                text = (await client.post("/detokenize", json={"tokens": [4, 2]})).json()
    assert [set(item) for item in rerank["results"]] == [
        {"index", "document", "relevance_score"}
    ] * 2
    assert [item["object"] for item in score["data"]] == ["score", "score"]
    assert text == {"prompt": "tok4 tok2 "}


def test_embedding_dim_flag() -> None:
    assert parse_settings(["--embedding-dim", "1024"]).embedding_dim == 1024
    with pytest.raises(SystemExit):
        parse_settings(["--embedding-dim", "0"])

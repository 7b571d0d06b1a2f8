"""The router in front of `grpc://` workers, over real loopback sockets: two fake gRPC
engines (processes of their own), the router in-process, an HTTP client.

What is held: OpenAI's answers made from the engines' token ids (role first, deltas,
finish reason, usage, `[DONE]`; unary assembled; `n > 1` by index; stop strings), the
gap answered with a 400 that names it (or served by an HTTP worker of the model), and
gRPC's statuses judged as the HTTP path judges their HTTP twins, counted by the engines'
own dispatch counters and the breaker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from router.cli.serve import RunningRouter
from router.fake_worker.behaviour import FailMode
from router.fake_worker.settings import FakeWorkerSettings
from router.fake_worker.vocabulary import write_tokenizer
from router.http.grpc import open_grpc_pool
from router.pipeline.dispatch import AttemptFailed
from router.pipeline.grpc_dispatch import GrpcEngines
from router.prompts.tokenizer import HfTokenizer
from tests.support.failover import scrape
from tests.support.fake_fleet import open_fake_fleet
from tests.support.grpc_fake_process import FakeGrpcEngine, fake_grpc_engine
from tests.support.http_client import RawClient
from tests.support.router_instance import open_router

GUARD_S = 30
MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
WORDS = " tok0 tok1 tok2 tok3"
"""What the fake's four tokens read as, decoded here after the prompt (its word-level
tokenizer puts a space before every word)."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeGrpcEngine, ...]]:
    model_dir = tmp_path_factory.mktemp("model")
    flags = ("--model", MODEL, "--tokens", "4")
    with fake_grpc_engine(model_dir, *flags) as a, fake_grpc_engine(model_dir, *flags) as b:
        yield a, b


@asynccontextmanager
async def router_before(*urls: str, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    overrides.setdefault("policy", "round_robin")
    async with (
        open_router([f"{url},model={MODEL}" for url in urls], **overrides) as running,
        httpx.AsyncClient(base_url=running.url, timeout=GUARD_S) as client,
    ):
        client.running = running  # type: ignore[attr-defined]
        yield client


def running_of(client: httpx.AsyncClient) -> RunningRouter:
    running: RunningRouter = client.running  # type: ignore[attr-defined]
    return running


def events(text: str) -> list[Any]:
    """The data of each SSE event: parsed JSON, or the raw text (`[DONE]`)."""
    found: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                found.append(data if data == "[DONE]" else orjson.loads(data))
    return found


async def faults_of(client: httpx.AsyncClient, url: str) -> int:
    workers = (await client.get("/v1/workers")).json()["workers"]
    (worker,) = [w for w in workers if w["url"] == url]
    faults: int = worker["breaker"]["consecutive_faults"]
    return faults


async def test_chat_unary_and_streamed_are_openai_answers(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            unary = await client.post("/v1/chat/completions", json=CHAT)
            streamed = await client.post(
                "/v1/chat/completions",
                json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            )
    assert unary.status_code == 200, unary.text
    body = unary.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": WORDS, "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    # The chat template renders "<bos>user: hello there\nassistant: ": 7 tokens.
    assert body["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 11,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert streamed.status_code == 200
    assert streamed.headers["content-type"] == "text/event-stream"
    seen = events(streamed.text)
    assert seen[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content", "") for e in seen[1:-2]]
    assert "".join(deltas) == WORDS
    assert [e["choices"][0]["finish_reason"] for e in seen[1:-2]][-1] == "stop"
    assert seen[-2]["choices"] == [] and seen[-2]["usage"]["completion_tokens"] == 4
    assert seen[-1] == "[DONE]"
    assert len({e["id"] for e in seen[:-1]}) == 1
    assert (await a.routing())["dispatches"] == 2


async def test_the_calls_share_one_connection_shown_on_metrics(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:

            async def one() -> None:
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
            metrics = (await client.get("/metrics")).text
    figures = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("router_grpc_")
    }
    assert figures["router_grpc_connections"] == 1
    assert figures["router_grpc_connections_opened_total"] == 1
    assert figures['router_grpc_calls{state="open"}'] == 0
    assert (await a.routing())["dispatches"] == 8


async def test_completions_n_2_by_index_and_a_stop_string(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    body = {"model": MODEL, "prompt": "hello", "n": 2, "max_tokens": 4}
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
            stopped = await client.post("/v1/completions", json={**body, "n": 1, "stop": "tok2"})
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for event in events(streamed.text)[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: WORDS, 1: WORDS}
    assert finishes == {0: "length", 1: "length"}
    (choice,) = stopped.json()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        " tok0 tok1 ",
        "stop",
        "tok2",
    )


def sampled(k: int) -> float:
    """The fake engine's logprob of its `k`-th token (`output_logprob`)."""
    return -0.125 * (1 + k % 5)


def chat_entry(k: int, alternatives: int) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    top = [one(f"tok{k + rank}", sampled(k) - rank) for rank in range(alternatives)]
    return {**one(f"tok{k}", sampled(k)), "top_logprobs": top}


async def test_logprobs_come_from_the_engine_in_each_apis_shape(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    chat = {**CHAT, "logprobs": True, "top_logprobs": 2}
    completions = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            chat_unary = await client.post("/v1/chat/completions", json=chat)
            chat_stream = await client.post("/v1/chat/completions", json={**chat, "stream": True})
            plain_unary = await client.post("/v1/completions", json={**completions, "logprobs": 0})
            plain_stream = await client.post(
                "/v1/completions", json={**completions, "logprobs": 1, "stream": True}
            )
    expected = [chat_entry(k, 2) for k in range(4)]
    assert chat_unary.json()["choices"][0]["logprobs"] == {"content": expected}
    chunks = [e for e in events(chat_stream.text) if e != "[DONE]"]
    # The role chunk has none; every chunk with text carries its tokens' logprobs.
    assert chunks[0]["choices"][0]["logprobs"] is None
    streamed = [entry for c in chunks[1:] for entry in c["choices"][0]["logprobs"]["content"]]
    assert streamed == expected
    assert plain_unary.json()["choices"][0]["logprobs"] == {
        "text_offset": [0, 4, 8, 12],
        "token_logprobs": [sampled(k) for k in range(4)],
        "tokens": [f"tok{k}" for k in range(4)],
        "top_logprobs": [{f"tok{k}": sampled(k)} for k in range(4)],
    }
    pieces = [e["choices"][0] for e in events(plain_stream.text) if e != "[DONE]"]
    joined: dict[str, list[Any]] = {"text_offset": [], "tokens": [], "top_logprobs": []}
    for piece in pieces:
        for key, values in joined.items():
            values.extend(piece["logprobs"][key])
    # Offsets go on from the tokens' own texts, streamed or not, as vLLM counts them (not
    # from the text streamed: " tok0" is five characters, its token "tok0" four).
    assert joined == {
        "text_offset": [0, 4, 8, 12],
        "tokens": [f"tok{k}" for k in range(4)],
        "top_logprobs": [{f"tok{k}": sampled(k)} for k in range(4)],
    }


async def test_a_request_the_grpc_path_cannot_serve_is_a_400_naming_the_gap(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            refused = await client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 2})
            tools = await client.post(
                "/v1/chat/completions",
                json={**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
            )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_over_grpc"
    assert refused.json()["error"]["message"].startswith(
        "prompt logprobs (`prompt_logprobs`) over gRPC is not supported"
    )
    assert "tool calls" in tools.json()["error"]["message"]
    assert (await a.routing())["dispatches"] == 0


async def test_the_gap_goes_to_an_http_worker_of_the_model_when_there_is_one(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([FakeWorkerSettings(model=MODEL)]) as fleet:
            async with router_before(a.url, fleet[0].url) as client:
                answers = [
                    await client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 1})
                    for _ in range(3)
                ]
                plain = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
            # Generation requests only: the fake counts the token sources' probe of its
            # /tokenize (the model directory checked against the engine) as a dispatch too.
            http_dispatches = len(fleet[0].worker.routing.headers)
    assert [r.status_code for r in answers + plain] == [200] * 5
    assert {r.headers["x-router-worker"] for r in answers} == {fleet[0].url}
    # Round robin over both for the plain ones: one each.
    assert (await a.routing())["dispatches"] == 1
    assert http_dispatches == 4


async def test_unavailable_fails_over_and_counts_for_the_breaker(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    await a.behave(fail_first=-1, fail_status=503)
    await b.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url, b.url) as client:
            answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
            faults = await faults_of(client, a.url)
    assert [r.status_code for r in answers] == [200, 200]
    assert [r.json()["choices"][0]["message"]["content"] for r in answers] == [WORDS] * 2
    assert {r.headers["x-router-worker"] for r in answers} == {b.url}
    failed, served = (await a.routing())["dispatches"], (await b.routing())["dispatches"]
    assert failed >= 1 and served == 2
    assert faults == failed  # each a fault on a's breaker


async def test_resource_exhausted_fails_over_without_tripping(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    await a.behave(fail_first=-1, fail_status=429)
    await b.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url, b.url) as client:
            answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
            faults = await faults_of(client, a.url)
    assert [r.status_code for r in answers] == [200, 200]
    assert {r.headers["x-router-worker"] for r in answers} == {b.url}
    failed, served = (await a.routing())["dispatches"], (await b.routing())["dispatches"]
    assert failed >= 1 and served == 2
    assert faults == 0  # backpressure: never a fault


async def test_resource_exhausted_everywhere_is_the_last_429(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    await a.behave(fail_first=-1, fail_status=429)
    await b.behave(fail_first=-1, fail_status=429)
    with trio.fail_after(GUARD_S):
        async with router_before(a.url, b.url) as client:
            answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 429
    assert answer.json()["error"]["message"] == "scripted failure: fake worker answers 429"


async def test_invalid_argument_is_the_clients_400_verbatim_without_failover(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    await a.behave(fail_first=-1, fail_status=400)
    await b.behave(fail_first=-1, fail_status=400)
    with trio.fail_after(GUARD_S):
        async with router_before(a.url, b.url) as client:
            answer = await client.post("/v1/chat/completions", json=CHAT)
            faults = [await faults_of(client, a.url), await faults_of(client, b.url)]
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "scripted failure: fake worker answers 400"
    dispatched = (await a.routing())["dispatches"] + (await b.routing())["dispatches"]
    assert dispatched == 1
    assert faults == [0, 0]


async def test_a_reset_before_the_first_token_fails_over(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, b = engines
    await a.behave(fail_first=-1, fail_mode="reset")
    await b.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url, b.url) as client:
            answers = [
                await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
                for _ in range(2)
            ]
            faults = await faults_of(client, a.url)
    assert [events(r.text)[-1] for r in answers] == ["[DONE]", "[DONE]"]
    failed, served = (await a.routing())["dispatches"], (await b.routing())["dispatches"]
    assert failed >= 1 and served == 2
    assert faults == failed


async def test_a_stream_broken_after_the_first_token_ends_with_an_error_event(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave(fail_first=1, fail_mode="midstream", fail_after_chunks=2, fail_status=500)
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert answer.status_code == 200
    assert "data: [DONE]" not in answer.text
    assert answer.text.rstrip().split("\n")[-2] == "event: error"
    last = events(answer.text)[-1]
    assert last["error"]["code"] == "stream_interrupted"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events(answer.text)[:-1])
    assert text == " tok0 tok1"
    assert (await a.routing())["dispatches"] == 1


async def test_a_broken_http_stream_does_not_go_on_over_grpc(
    engines: tuple[FakeGrpcEngine, ...], tmp_path: Path
) -> None:
    """A continuation is the rest of a stream the client already has, asked as token ids
    and relayed past its seam: a grpc:// worker of the model would answer it from scratch
    (a second role, a second text), so it is not sent one; the stream ends with the error
    event and the gRPC engine sees only the request it served whole."""
    a, _ = engines
    await a.behave()
    breaking = FakeWorkerSettings(
        model=MODEL,
        engine="vllm",
        fail_first=1,
        fail_mode=FailMode.MIDSTREAM,
        fail_after_chunks=3,
    )
    vocabulary = str(write_tokenizer(tmp_path / "tokenizer.json"))
    body = {**CHAT, "stream": True, "max_tokens": 12}
    with trio.fail_after(GUARD_S):
        async with open_fake_fleet([breaking]) as fleet:
            http_url = fleet[0].url
            async with router_before(
                f"{http_url},engine=vllm", a.url, kv_tokenizer=vocabulary
            ) as client:
                answers = [await client.post("/v1/chat/completions", json=body) for _ in range(2)]
                resumes = await scrape(client, "router_resumes_total")
    (broken,) = [r for r in answers if "data: [DONE]" not in r.text]
    assert broken.headers["x-router-worker"] == http_url
    assert events(broken.text)[-1]["error"]["code"] == "stream_interrupted"
    roles = [e for e in events(broken.text)[:-1] if e["choices"][0]["delta"].get("role")]
    assert len(roles) == 1
    served_by_grpc = [r for r in answers if r.headers["x-router-worker"] == a.url]
    assert (await a.routing())["dispatches"] == len(served_by_grpc)
    assert {dict(labels)["outcome"]: n for labels, n in resumes.items()} == {"failed": 1}


async def test_a_client_that_leaves_mid_stream_aborts_the_engines_generation(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave(tokens=1000, token_latency_ms=20)
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            raw = await RawClient.connect(running_of(client).port)
            body = orjson.dumps({**CHAT, "stream": True})
            await raw.send_request("POST", "/v1/chat/completions", [], body)
            head = await raw.read_head("POST")
            assert head.status == 200
            assert await raw.read_chunk()  # the generation runs; leave
            await raw.aclose()
            while (await a.routing())["aborts"] < 1:  # noqa: ASYNC110 - the engine's counter
                await trio.sleep(0.02)
    routing = await a.routing()
    assert routing["aborts"] == 1
    assert routing["dispatches"] == 1
    await a.behave(tokens=4, token_latency_ms=0)


async def test_a_grpc_worker_learns_its_model_and_facts_and_is_health_checked_over_grpc(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave(healthy=False)
    with trio.fail_after(GUARD_S):
        async with (
            open_router([a.url], health_interval_s=0.05, health_failure_threshold=1) as running,
            httpx.AsyncClient(base_url=running.url, timeout=GUARD_S) as client,
        ):
            while True:
                (worker,) = (await client.get("/v1/workers")).json()["workers"]
                if worker["engine"] is not None and not worker["healthy"]:
                    break
                await trio.sleep(0.05)
            paths = (await a.routing())["paths"]
            await a.behave()
            while not (await client.get("/v1/workers")).json()["workers"][0]["healthy"]:  # noqa: ASYNC110 - the router's listing
                await trio.sleep(0.05)
    assert worker["model"] == [MODEL]
    assert (worker["engine"], worker["max_model_len"]) == ("vllm", {MODEL: 2048})
    assert paths["/vllm.grpc.engine.VllmEngine/HealthCheck"] >= 1


async def test_a_grpc_worker_has_no_http_model_list_reader(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    """The adapter lists are read from `/v1/models` over HTTP: beside an HTTP worker whose
    list is read, a grpc:// worker gets no reader, so no failed read is counted for it."""
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with (
            open_fake_fleet([FakeWorkerSettings(model=MODEL, engine="vllm")]) as fleet,
            router_before(a.url, fleet[0].url, adapter_list_interval_s=0.05) as client,
        ):
            # Several intervals pass: the HTTP worker's reader has read three times.
            reads: dict[Any, float] = {}
            while sum(reads.values()) < 3:
                reads = await scrape(client, "router_adapter_list_reads_total")
                await trio.sleep(0.05)
            readers = await scrape(client, "router_adapter_list_readers")
    assert list(readers.values()) == [1]
    assert {dict(labels)["outcome"] for labels, n in reads.items() if n} == {"ok"}


async def test_a_grpc_workers_engine_load_is_read_over_get_loads(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url, policy="least_load", engine_load_interval_s=0.05) as client:
            while True:
                (worker,) = (await client.get("/v1/workers")).json()["workers"]
                if (worker["engine_load"] or {}).get("requests") is not None:
                    break
                await trio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
    assert worker["engine_load"]["requests"] == 0  # the idle engine's own count
    assert (await a.routing())["paths"]["/vllm.grpc.engine.VllmEngine/GetLoads"] >= 1
    (ok,) = [
        line
        for line in metrics.splitlines()
        if line.startswith('router_engine_load_reads_total{outcome="ok",source="grpc_loads"}')
    ]
    assert float(ok.split()[-1]) >= 1


MESSAGES = {
    "model": MODEL,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "hello there"}],
}


def anthropic_events(text: str) -> list[tuple[str, Any]]:
    found = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        found.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return found


async def test_anthropic_messages_unary_and_streamed(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            unary = await client.post("/v1/messages", json=MESSAGES)
            streamed = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
            stopped = await client.post(
                "/v1/messages", json={**MESSAGES, "stop_sequences": ["tok2"]}
            )
    body = unary.json()
    assert (body["type"], body["role"], body["content"]) == (
        "message",
        "assistant",
        [{"type": "text", "text": WORDS}],
    )
    assert (body["stop_reason"], body["usage"]["output_tokens"]) == ("max_tokens", 4)
    seen = anthropic_events(streamed.text)
    assert [name for name, _ in seen][:2] == ["message_start", "content_block_start"]
    assert [name for name, _ in seen][-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert seen[0][1]["message"]["usage"]["input_tokens"] == body["usage"]["input_tokens"]
    text = "".join(d["delta"]["text"] for name, d in seen if name == "content_block_delta")
    assert text == WORDS
    assert seen[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert stopped.json()["stop_reason"] == "stop_sequence"
    assert stopped.json()["stop_sequence"] == "tok2"
    assert stopped.json()["content"] == [{"type": "text", "text": " tok0 tok1 "}]


async def test_a_broken_messages_stream_ends_with_anthropics_error_event(
    engines: tuple[FakeGrpcEngine, ...],
) -> None:
    a, _ = engines
    await a.behave(fail_first=1, fail_mode="midstream", fail_after_chunks=2, fail_status=500)
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            answer = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
    name, last = anthropic_events(answer.text)[-1]
    assert name == "error"
    assert last["type"] == "error" and last["error"]["code"] == "stream_interrupted"


RESPONSES = {"model": MODEL, "input": "hello there"}


async def test_responses_unary_and_streamed(engines: tuple[FakeGrpcEngine, ...]) -> None:
    a, _ = engines
    await a.behave()
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            unary = await client.post("/v1/responses", json=RESPONSES)
            streamed = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
            cut = await client.post("/v1/responses", json={**RESPONSES, "max_output_tokens": 2})
            refused = await client.post(
                "/v1/responses", json={**RESPONSES, "previous_response_id": "resp_1"}
            )
    body = unary.json()
    assert (body["object"], body["status"]) == ("response", "completed")
    (item,) = body["output"]
    assert item["content"] == [{"type": "output_text", "text": WORDS, "annotations": []}]
    assert body["usage"]["output_tokens"] == 4
    seen = anthropic_events(streamed.text)  # `event:` and `data:` lines, as Anthropic's
    names = [name for name, _ in seen]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in seen] == list(range(len(seen)))
    deltas = "".join(d["delta"] for name, d in seen if name == "response.output_text.delta")
    assert deltas == WORDS == seen[-4][1]["text"]
    assert seen[-1][1]["response"]["usage"]["output_tokens"] == 4
    assert cut.json()["status"] == "incomplete"
    assert cut.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert refused.status_code == 400
    assert "previous_response_id" in refused.json()["error"]["message"]


async def test_a_tokenizer_that_cannot_be_loaded_is_tried_again_only_after_a_while(
    engines: tuple[FakeGrpcEngine, ...], mock_clock: trio.testing.MockClock
) -> None:
    a, _ = engines
    loads: list[str] = []

    def load(path: str) -> HfTokenizer:
        loads.append(path)
        raise ValueError("no tokenizer here")

    with trio.fail_after(GUARD_S):
        async with open_grpc_pool() as pool:
            known = GrpcEngines(pool, GUARD_S, load, retry_s=10.0)
            for _ in range(3):
                with pytest.raises(AttemptFailed, match="no tokenizer here") as failed:
                    await known.get(a.url)
                assert not failed.value.fault  # the router's trouble, not the worker's
            mock_clock.jump(9.999)
            with pytest.raises(AttemptFailed):
                await known.get(a.url)
            assert len(loads) == 1
            mock_clock.jump(0.001)
            with pytest.raises(AttemptFailed):
                await known.get(a.url)
    assert loads == [str(a.model_dir.resolve())] * 2


async def test_sglangs_generate_unary_and_streamed(engines: tuple[FakeGrpcEngine, ...]) -> None:
    a, _ = engines
    await a.behave()
    body = {"model": MODEL, "text": "hello there", "sampling_params": {"max_new_tokens": 4}}
    with trio.fail_after(GUARD_S):
        async with router_before(a.url) as client:
            unary = await client.post("/generate", json=body)
            streamed = await client.post("/generate", json={**body, "stream": True})
            ids = await client.post(
                "/generate", json={"model": MODEL, "input_ids": [5, 6], "sampling_params": {}}
            )
    assert unary.json()["text"] == WORDS
    meta = unary.json()["meta_info"]
    assert (meta["finish_reason"], meta["completion_tokens"]) == (
        {"type": "length", "length": 4},
        4,
    )
    seen = events(streamed.text)
    assert seen[-1] == "[DONE]"
    assert [e["text"] for e in seen[:-1]][-1] == WORDS  # each event the text so far
    assert seen[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    # No max_new_tokens: SGLang's 128 is the limit the engine gets; the fake stops at 4.
    assert ids.json()["meta_info"]["finish_reason"]["type"] == "length"

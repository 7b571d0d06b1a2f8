"""The fake engine's token ids, as vLLM gives them: streamed when asked for, a prompt taken
as ids (completions, chat's `kv_transfer_params.prompt_token_ids`), a greedy rule under
which the continuation of `prompt + generated` is the unbroken run, stop strings held back
and ended on, and a scripted break that cuts the request's own answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from tokenizers import Tokenizer

from router.fake_worker.apis import paced_events, parse_request, stream_frames
from router.fake_worker.behaviour import Behaviour, FailMode
from router.fake_worker.formats import Api, BadGenerationRequest, expected_text
from router.fake_worker.settings import FakeWorkerSettings
from router.fake_worker.stats import RankLoad
from router.fake_worker.vocabulary import first_token, word_ids, write_tokenizer
from tests.support.fake_fleet import open_fake_fleet

CHAT = {"messages": [{"role": "user", "content": "say something"}], "max_tokens": 6}
COMPLETIONS = {"prompt": "say something", "max_tokens": 6}


def stream(api: Api, body: dict[str, Any], *, vllm: bool = True) -> list[dict[str, Any]]:
    """The data events of a streamed answer, parsed (`[DONE]` left out)."""
    gen = parse_request(api, {**body, "stream": True}, 16, "m")
    out = []
    for raw in paced_events(stream_frames(gen, "x-1", 0, vllm=vllm), Behaviour(), RankLoad()):
        assert isinstance(raw, bytes)
        payload = raw.removeprefix(b"data: ").rstrip(b"\n")
        if payload != b"[DONE]":
            out.append(orjson.loads(payload))
    return out


def text_and_ids(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    text, ids = "", []
    for event in events:
        for choice in event["choices"]:
            text += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            ids += choice.get("token_ids") or []
    return text, ids


def test_ids_run_from_zero_and_read_as_the_text() -> None:
    for api, body in ((Api.CHAT, CHAT), (Api.COMPLETIONS, COMPLETIONS)):
        text, ids = text_and_ids(stream(api, {**body, "return_token_ids": True}))
        assert (text, ids) == (expected_text(6), list(range(6)))


def test_the_prompt_ids_ride_on_the_first_event_only() -> None:
    chat = stream(Api.CHAT, {**CHAT, "return_token_ids": True})
    assert chat[0]["prompt_token_ids"] == word_ids("say something")
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    completions = stream(Api.COMPLETIONS, {**COMPLETIONS, "return_token_ids": True})
    assert completions[0]["choices"][0]["prompt_token_ids"] == word_ids("say something")
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in completions[1:] if e["choices"])


def test_without_the_ask_every_id_is_null_and_the_text_the_same() -> None:
    for api, body in ((Api.CHAT, CHAT), (Api.COMPLETIONS, COMPLETIONS)):
        events = stream(api, body)
        assert all(
            choice.get("token_ids") is None for event in events for choice in event["choices"]
        )
        assert text_and_ids(events) == (expected_text(6), [])


def test_sglang_ignores_the_ask() -> None:
    events = stream(Api.CHAT, {**CHAT, "return_token_ids": True}, vllm=False)
    assert "prompt_token_ids" not in events[0]
    assert text_and_ids(events) == (expected_text(6), [])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_continuation_of_prompt_and_generated_is_the_unbroken_run(k: int) -> None:
    prompt = word_ids("say something")
    body = {"prompt": [*prompt, *range(k)], "max_tokens": 6 - k, "return_token_ids": True}
    events = stream(Api.COMPLETIONS, body)
    _, ids = text_and_ids(events)
    assert ids == list(range(k, 6))
    # Its first delta decodes the generated ids again, as vLLM's does (#48853): text the
    # router must not relay.
    assert events[0]["choices"][0]["text"] == expected_text(k) + f"tok{k} "


def test_a_chat_prompt_of_ids_counts_and_continues_as_ids() -> None:
    body = {**CHAT, "kv_transfer_params": {"prompt_token_ids": [7, 0, 1]}, "max_tokens": 2}
    gen = parse_request(Api.CHAT, {**body, "stream": True}, 16, "m")
    assert (gen.prompt_tokens, gen.first) == (3, 2)
    with pytest.raises(BadGenerationRequest) as refused:
        parse_request(Api.CHAT, {**CHAT, "kv_transfer_params": {"prompt_token_ids": []}}, 16, "m")
    assert refused.value.param == "kv_transfer_params.prompt_token_ids"


def test_the_next_token_rule() -> None:
    assert first_token([]) == 0
    assert first_token([9, 0, 1, 2]) == 3
    assert first_token([0]) == 1
    assert first_token([1000, 1049]) == 0
    assert first_token([9, 1, 2]) == 0  # a run must start at 0


def test_a_stop_string_is_held_back_then_ends_the_answer_where_vllm_does() -> None:
    events = stream(
        Api.COMPLETIONS,
        {**COMPLETIONS, "stop": ["3 tok"], "stream_options": {"include_usage": True}},
    )
    choices = [e["choices"][0] for e in events if e["choices"]]
    deltas = [c["text"] for c in choices]
    # 4 characters held back (len("3 tok") - 1), all of the text up to the stop given out.
    assert deltas[:2] == ["t", "ok0 t"]
    assert "".join(deltas) == "tok0 tok1 tok2 tok"
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("stop", "3 tok")
    assert events[-1]["usage"]["completion_tokens"] == 5  # tok4 completed the stop string


def test_the_vocabulary_file_decodes_each_id_to_its_text(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(write_tokenizer(tmp_path / "tokenizer.json")))
    assert tokenizer.decode([0, 1, 49_999]) == "tok0 tok1 tok49999 "


async def test_a_break_mid_stream_cuts_the_requests_own_answer() -> None:
    broken = FakeWorkerSettings(
        engine="vllm", fail_first=-1, fail_mode=FailMode.MIDSTREAM, fail_after_chunks=3
    )
    body = {**COMPLETIONS, "model": "fake-model", "stream": True, "return_token_ids": True}
    received: list[dict[str, Any]] = []
    with trio.fail_after(10):
        async with open_fake_fleet([broken]) as fleet:
            async with httpx.AsyncClient(base_url=fleet[0].url) as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: "):
                                received.append(orjson.loads(line[6:]))
    assert text_and_ids(received) == (expected_text(3), [0, 1, 2])
    assert received[0]["choices"][0]["prompt_token_ids"] == word_ids("say something")

"""The client's stream after the seam: a seam opens only where the ids account for the
text the client got, and the continuation becomes the rest of the original stream (its id,
its model, the router's own text, one usage, stop strings across the seam)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from router.fake_worker.apis import paced_events, parse_request, stream_frames
from router.fake_worker.behaviour import Behaviour
from router.fake_worker.formats import Api, expected_text
from router.fake_worker.stats import RankLoad
from router.fake_worker.vocabulary import write_tokenizer
from router.pipeline.continuation import ContinuationRelay, Seam, open_seam
from router.pipeline.resume import Refusal, continuation_body
from router.pipeline.stream_capture import GarbledEvent, StreamCapture
from router.prompts.tokenizer import HfTokenizer

CHAT = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 8}
COMPLETIONS = {"prompt": "a b c", "max_tokens": 8}
USAGE = {"stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(str(write_tokenizer(tmp_path_factory.mktemp("fake") / "tokenizer.json")))


def events(api: Api, body: dict[str, Any], request_id: str, created: int) -> list[bytes]:
    gen = parse_request(api, {**body, "stream": True}, 16, "m")
    frames = stream_frames(gen, request_id, created, vllm=True)
    return [e for e in paced_events(frames, Behaviour(), RankLoad()) if isinstance(e, bytes)]


def client_view(stream: bytes) -> tuple[str, set[Any], list[dict[str, Any]], int]:
    """The text, the ids of the events, their usage and how many `[DONE]`."""
    text, ids, usage, done = "", set(), [], 0
    for raw in stream.split(b"\n\n"):
        if not raw:
            continue
        payload = raw.removeprefix(b"data: ")
        if payload == b"[DONE]":
            done += 1
            continue
        chunk = orjson.loads(payload)
        ids.add((chunk["id"], chunk["created"], chunk["model"]))
        if chunk.get("usage"):
            usage.append(chunk["usage"])
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
    return text, ids, usage, done


def broken_then_resumed(
    api: Api, body: dict[str, Any], k: int, tokenizer: HfTokenizer
) -> tuple[bytes, Seam]:
    """What the client gets: the first `k` events of a stream, then the continuation on
    another fake, through the router's capture and relay."""
    route = "chat" if api is Api.CHAT else "completions"
    capture = StreamCapture(strip=True, max_ids=10_000)
    first = capture.feed(b"".join(events(api, {**body, "return_token_ids": True}, "orig", 7)[:k]))
    seam = open_seam(capture, tokenizer, route, body)
    assert isinstance(seam, Seam)
    parsed, _ = continuation_body(route, body, seam.prompt_ids, seam.generated)
    relay = ContinuationRelay(seam)
    rest = b""
    for raw in events(api, parsed, "other", 99):
        rest += relay.feed(raw)
        if relay.complete:
            break
    assert relay.complete
    return first + rest, seam


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_the_resumed_stream_is_the_unbroken_one(api: Api, k: int, tokenizer: HfTokenizer) -> None:
    body = {**(CHAT if api is Api.CHAT else COMPLETIONS), **USAGE}
    resumed, _ = broken_then_resumed(api, body, k, tokenizer)
    text, ids, usage, done = client_view(resumed)
    unbroken_text, _, unbroken_usage, _ = client_view(b"".join(events(api, body, "u", 1)))
    assert text == unbroken_text == expected_text(8)
    assert ids == {("orig", 7, "m")}
    assert usage == unbroken_usage  # one usage, the original prompt and all 8 tokens
    assert done == 1


def test_the_continuations_own_text_is_never_relayed(tokenizer: HfTokenizer) -> None:
    resumed, _ = broken_then_resumed(Api.COMPLETIONS, COMPLETIONS, 4, tokenizer)
    # The fake's continuation re-emits "tok0 tok1 tok2 " before "tok3 " (as vLLM #48853).
    assert client_view(resumed)[0] == expected_text(8)


def test_a_stop_string_across_the_seam_ends_where_the_unbroken_run_ends(
    tokenizer: HfTokenizer,
) -> None:
    body = {**COMPLETIONS, **USAGE, "stop": ["2 tok3 t"]}
    unbroken_text, _, unbroken_usage, _ = client_view(
        b"".join(events(Api.COMPLETIONS, body, "u", 1))
    )
    assert unbroken_text == "tok0 tok1 tok"
    for k in (1, 2, 3):
        resumed, seam = broken_then_resumed(Api.COMPLETIONS, body, k, tokenizer)
        text, _, usage, done = client_view(resumed)
        assert (text, usage, done) == (unbroken_text, unbroken_usage, 1)
        assert seam.text.stopped_by == "2 tok3 t"
        assert b'"finish_reason":"stop","stop_reason":"2 tok3 t"' in resumed


def test_text_the_ids_do_not_account_for_refuses_the_seam(tokenizer: HfTokenizer) -> None:
    capture = StreamCapture(strip=True, max_ids=1000)
    stream = b"".join(events(Api.CHAT, {**CHAT, "return_token_ids": True}, "c", 1)[:3])
    capture.feed(stream.replace(b'"tok1 "', b'"tok1 extra"'))
    assert open_seam(capture, tokenizer, "chat", CHAT) is Refusal.HELD_BACK
    assert open_seam(capture, None, "chat", CHAT) is Refusal.NO_TOKENIZER
    assert open_seam(StreamCapture(strip=True, max_ids=9), tokenizer, "chat", CHAT) is (
        Refusal.NO_IDS
    )


def test_a_continuation_token_without_its_id_is_garbled(tokenizer: HfTokenizer) -> None:
    capture = StreamCapture(strip=True, max_ids=1000)
    capture.feed(b"".join(events(Api.CHAT, {**CHAT, "return_token_ids": True}, "c", 1)[:2]))
    seam = open_seam(capture, tokenizer, "chat", CHAT)
    assert isinstance(seam, Seam)
    relay = ContinuationRelay(seam)
    plain = events(Api.CHAT, CHAT, "d", 2)
    assert relay.feed(plain[0]) == b""  # its role event: the client had one
    with pytest.raises(GarbledEvent):
        relay.feed(plain[1])


def test_the_vocabulary_file_is_what_the_tests_decode_with(tmp_path: Path) -> None:
    tokenizer = HfTokenizer(str(write_tokenizer(tmp_path)))
    step = tokenizer.decode_stream([1, 2])
    assert [step(i) for i in (3, 4)] == ["tok3 ", "tok4 "]

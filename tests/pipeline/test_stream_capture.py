"""Capture while relaying: the ids and text a stream gave its client are kept, the ids the
router asked for are cut out so the client gets the bytes it would have got without them,
and what a resume could not account for is noted as it passes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.fake_worker.apis import paced_events, parse_request, stream_frames
from router.fake_worker.behaviour import Behaviour
from router.fake_worker.formats import Api, expected_text
from router.fake_worker.stats import RankLoad
from router.fake_worker.vocabulary import word_ids
from router.pipeline.resume import Refusal
from router.pipeline.stream_capture import GarbledEvent, StreamCapture, null_id_arrays

BODIES = {
    Api.CHAT: {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 5},
    Api.COMPLETIONS: {"prompt": "a b c", "max_tokens": 5},
}


def fake_stream(api: Api, **extra: Any) -> bytes:
    """A vLLM fake's whole streamed answer, as bytes."""
    body = {**BODIES[api], "stream": True, "stream_options": {"include_usage": True}, **extra}
    gen = parse_request(api, body, 16, "m")
    frames = stream_frames(gen, "x-1", 7, vllm=True)
    return b"".join(
        e for e in paced_events(frames, Behaviour(), RankLoad()) if isinstance(e, bytes)
    )


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
def test_the_client_gets_the_bytes_it_would_have_got_without_ids(api: Api) -> None:
    capture = StreamCapture(strip=True, max_ids=1000)
    relayed = capture.feed(fake_stream(api, return_token_ids=True))
    assert relayed == fake_stream(api)
    assert list(capture.generated) == [0, 1, 2, 3, 4]
    assert list(capture.prompt_ids or ()) == word_ids("a b c")
    assert (capture.text, capture.finish_reason, capture.done) == (expected_text(5), "length", True)
    assert (capture.response_id, capture.created, capture.model) == ("x-1", 7, "m")


def test_ids_the_client_asked_for_stay() -> None:
    stream = fake_stream(Api.CHAT, return_token_ids=True)
    capture = StreamCapture(strip=False, max_ids=1000)
    assert capture.feed(stream) == stream
    assert list(capture.generated) == [0, 1, 2, 3, 4]


def test_events_fed_in_any_cut_keep_the_same_ids() -> None:
    stream = fake_stream(Api.COMPLETIONS, return_token_ids=True)
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    capture = StreamCapture(strip=True, max_ids=1000)
    out = b"".join(capture.feed(b"".join(events[i : i + 2])) for i in range(0, len(events), 2))
    assert out == fake_stream(Api.COMPLETIONS)
    assert list(capture.generated) == [0, 1, 2, 3, 4]


def test_only_keys_are_nulled_never_text_that_looks_like_one() -> None:
    text = orjson.dumps({"text": '"token_ids":[1]', "token_ids": [4, 5], "x": 1})
    assert orjson.loads(null_id_arrays(text)) == {
        "text": '"token_ids":[1]',
        "token_ids": None,
        "x": 1,
    }


def event(choice: dict[str, Any], **top: Any) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", **top}
    chunk["choices"] = [{"index": 0, **choice}]
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


ROLE = event({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[9, 9])


@pytest.mark.parametrize(
    ("delta", "reason"),
    [
        ({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}, Refusal.TOOL_CALL_OPEN),
        ({"reasoning": "hmm"}, Refusal.REASONING_OPEN),
        ({"reasoning_content": "hmm"}, Refusal.REASONING_OPEN),
    ],
)
def test_a_tool_call_or_reasoning_makes_the_stream_unresumable(
    delta: dict[str, Any], reason: Refusal
) -> None:
    capture = StreamCapture(strip=True, max_ids=1000)
    capture.feed(ROLE + event({"delta": {"content": "x"}, "token_ids": [1]}))
    capture.feed(event({"delta": delta, "token_ids": [2]}))
    assert capture.unresumable is reason
    assert (list(capture.generated), capture.texts) == ([], [])


def test_text_without_ids_and_too_many_ids_make_it_unresumable() -> None:
    no_ids = StreamCapture(strip=True, max_ids=1000)
    no_ids.feed(ROLE + event({"delta": {"content": "x"}}))
    assert no_ids.unresumable is Refusal.NO_IDS
    bounded = StreamCapture(strip=True, max_ids=3)
    bounded.feed(ROLE + event({"delta": {"content": "x"}, "token_ids": [1]}))
    assert bounded.unresumable is None
    bounded.feed(event({"delta": {"content": "y"}, "token_ids": [2]}))
    assert bounded.unresumable is Refusal.IDS_BOUND
    # The ids are still cut out of what the client gets.
    assert b"[3]" not in bounded.feed(event({"delta": {"content": "z"}, "token_ids": [3]}))


def test_an_event_that_is_not_json_is_garbled() -> None:
    capture = StreamCapture(strip=True, max_ids=1000)
    with pytest.raises(GarbledEvent):
        capture.feed(ROLE + b"data: {<html>\n\n")

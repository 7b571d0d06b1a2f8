"""The expectations on what a stream said (`stream_text`, `stream_usage`, `stream_ids`):
a whole answer passes, a cut one or one made of two answers fails with a line saying why."""

from __future__ import annotations

import json
from typing import Any

from conformance.client import Answer
from conformance.expect import check_answers
from conformance.model import Expect

WHOLE = Expect(
    stream_text="tok0 tok1 ",
    stream_usage={"prompt_tokens": 1, "completion_tokens": 2},
    stream_ids=1,
)


def sse(*chunks: dict[str, Any], done: bool = True) -> Answer:
    body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)
    return Answer(status=200, body=(body + ("data: [DONE]\n\n" if done else "")).encode())


def token(text: str, id_: str = "a") -> dict[str, Any]:
    return {"id": id_, "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"id": "a", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}


def test_a_whole_stream_passes() -> None:
    assert check_answers(WHOLE, [sse(token("tok0 "), token("tok1 "), USAGE)]) == []


def test_a_cut_stream_fails_on_its_text_and_usage() -> None:
    failures = check_answers(WHOLE, [sse(token("tok0 "), done=False)])
    assert [line.split(":")[0] for line in failures] == ["stream_text", "stream_usage"]


def test_a_stream_of_two_answers_fails_on_its_ids_and_its_usages() -> None:
    answer = sse(token("tok0 "), token("tok1 ", "b"), USAGE, USAGE)
    failures = check_answers(WHOLE, [answer])
    assert [line.split(":")[0] for line in failures] == ["stream_usage", "stream_ids"]


def test_completions_text_counts_too() -> None:
    chunk = {"id": "a", "choices": [{"index": 0, "text": "tok0 tok1 "}]}
    assert check_answers(Expect(stream_text="tok0 tok1 "), [sse(chunk)]) == []

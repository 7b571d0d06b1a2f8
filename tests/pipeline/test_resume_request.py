"""A request's resume looks up the local tokenizer of the model it is planned for at each
first attempt: a fallback to another model asks for that model's ids, or none."""

from __future__ import annotations

import orjson

from router.fleet.records import WorkerRecord
from router.fleet.registry import Worker
from router.pipeline.resolve import parse_generation_request
from router.pipeline.resume import Refusal, ResumeSettings
from router.pipeline.resume_request import RequestResume
from router.pipeline.stream_capture import StreamCapture
from router.prompts.tokenizer import TextTokenizer

BODY = {"prompt": "hello", "max_tokens": 8, "stream": True}


class Words:
    """Stands for a model's tokenizer: the resume only asks whether there is one."""


def worker(model: str) -> Worker:
    url = f"http://{model}.test"
    return Worker(record=WorkerRecord(id=url, url=url, models=(model,), engine="vllm"))


def test_the_tokenizer_is_the_one_of_the_model_the_attempt_is_for() -> None:
    asked: list[str] = []
    tokenizer = Words()

    def tokenizers(model: str) -> TextTokenizer | None:
        asked.append(model)
        return tokenizer if model == "with-ids" else None  # type: ignore[return-value]

    raw = orjson.dumps({"model": "plain", **BODY})
    generation = parse_generation_request("/v1/completions", raw, ["plain", "with-ids"])
    resume = RequestResume(ResumeSettings(limit=2), generation, tokenizers)

    body, events = resume.prepare(worker("plain"), raw)
    assert (body, events) == (raw, None)  # nothing to make the text with: no ids asked
    assert resume.decide(worker("plain")) is Refusal.NO_TOKENIZER

    generation.set_members(model="with-ids")  # what a fallback does to the request
    generation.model = "with-ids"
    body, events = resume.prepare(worker("with-ids"), generation.raw)
    assert isinstance(events, StreamCapture)
    assert orjson.loads(body)["return_token_ids"] is True
    resume.prepare(worker("with-ids"), generation.raw)
    assert asked == ["plain", "with-ids"]  # once per model

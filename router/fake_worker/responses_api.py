"""The OpenAI Responses API (`/v1/responses`) as a fake engine speaks it: parse a request,
render the response object and its SSE event sequence.

Generation is the fake one of `formats` (`tok0 tok1 ...`); usage counts are honest
(prompt tokens are the words of `instructions` and `input`). A stream is
`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per token,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`
and `response.completed` (no `[DONE]`: the Responses API does not send one).
"""

from __future__ import annotations

from typing import Any

import orjson

from router.fake_worker.behaviour import MAX_TOKENS
from router.fake_worker.formats import (
    Api,
    BadGenerationRequest,
    Generation,
    content_words,
    count_words,
    expected_text,
    token_bytes,
)


def parse_response_request(body: Any, default_tokens: int, default_model: str) -> Generation:
    if not isinstance(body, dict):
        raise BadGenerationRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        model = default_model
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadGenerationRequest("'stream' must be true or false")
    limit = body.get("max_output_tokens")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_TOKENS
    ):
        raise BadGenerationRequest(
            f"'max_output_tokens' must be an integer between 0 and {MAX_TOKENS}"
        )
    prompt = _input_tokens(body.get("input"))
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        prompt += count_words(instructions)
    return Generation(
        api=Api.RESPONSES,
        model=model,
        stream=stream,
        tokens=default_tokens if limit is None else limit,
        explicit_limit=limit is not None,
        n=1,
        prompt_tokens=prompt,
        include_usage=True,
    )


def _input_tokens(value: Any) -> int:
    if isinstance(value, str):
        return count_words(value)
    if not isinstance(value, list) or not value:
        raise BadGenerationRequest("'input' must be a string or a non-empty list of input items")
    total = 0
    for item in value:
        if not isinstance(item, dict):
            raise BadGenerationRequest("each 'input' item must be an object")
        total += content_words(item.get("content"))
    return total


def _usage(gen: Generation, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": gen.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": gen.prompt_tokens + output_tokens,
    }


def _message(gen: Generation, item_id: str, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    )
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def response_object(
    gen: Generation, response_id: str, created: int, *, done: bool
) -> dict[str, Any]:
    """The response object: finished (`done`, with output and usage) or just begun."""
    status = "in_progress"
    incomplete = None
    output: list[dict[str, Any]] = []
    usage = None
    if done:
        # Generating exactly the limit the client set means the limit cut it short.
        status = "incomplete" if gen.explicit_limit else "completed"
        incomplete = {"reason": "max_output_tokens"} if gen.explicit_limit else None
        output = [_message(gen, _item_id(response_id), expected_text(gen.tokens), "completed")]
        usage = _usage(gen, gen.tokens)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": gen.tokens if gen.explicit_limit else None,
        "model": gen.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }


def response_body(gen: Generation, response_id: str, created: int) -> bytes:
    return orjson.dumps(response_object(gen, response_id, created, done=True))


def _item_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


class ResponseFrames:
    """The SSE events of one streaming response, in the shape `paced_events` walks:
    `head()`, `token(i, choice)` per token, `tail()`."""

    def __init__(self, gen: Generation, response_id: str, created: int) -> None:
        self.gen = gen
        self.response_id = response_id
        self.created = created
        self.item_id = _item_id(response_id)
        self._sequence = 0
        self._delta_prefix = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":'
            + orjson.dumps(self.item_id)
            + b',"output_index":0,"content_index":0,"logprobs":[],"delta":"'
        )

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._next(), **payload}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _next(self) -> int:
        number = self._sequence
        self._sequence += 1
        return number

    def head(self) -> list[bytes]:
        begun = response_object(self.gen, self.response_id, self.created, done=False)
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.created", {"response": begun}),
            self._event("response.in_progress", {"response": begun}),
            self._event(
                "response.output_item.added",
                {"output_index": 0, "item": _message(self.gen, self.item_id, "", "in_progress")},
            ),
            self._event("response.content_part.added", {**where, "part": part}),
        ]

    def token(self, i: int, choice: int = 0) -> bytes:
        return (
            self._delta_prefix
            + token_bytes(i)
            + b'","sequence_number":'
            + str(self._next()).encode()
            + b"}\n\n"
        )

    def tail(self) -> list[bytes]:
        text = expected_text(self.gen.tokens)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        done = response_object(self.gen, self.response_id, self.created, done=True)
        final = "response.incomplete" if self.gen.explicit_limit else "response.completed"
        return [
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": part}),
            self._event(
                "response.output_item.done",
                {"output_index": 0, "item": _message(self.gen, self.item_id, text, "completed")},
            ),
            self._event(final, {"response": done}),
        ]

"""The client's answer made from a gRPC generation: the bytes of each API's stream events
and unary bodies, as the engines' own HTTP servers write them.

- OpenAI chat completions and completions (`OpenAIAnswer`), as vLLM writes them: a chat
  stream opens each choice with a `role` chunk; deltas; the finish reason (and vLLM's
  `stop_reason`) with the last delta; a usage chunk when asked; `[DONE]`. Logprobs, when
  asked, ride on the chunk of the engine's step that generated their tokens, which may
  carry no text while a character or a possible stop string is incomplete.
- Anthropic Messages (`AnthropicAnswer`): `message_start` (with the input tokens),
  one text block (`content_block_start`, `text_delta`s, `content_block_stop`),
  `message_delta` with the stop reason and output tokens, `message_stop`.
- OpenAI Responses (`ResponsesAnswer`): `response.created`, `response.in_progress`, one
  message item with one `output_text` part (`output_item.added`, `content_part.added`,
  `output_text.delta`s, then their `done` events), and `response.completed` (or
  `response.incomplete` when the output token limit ended it) with the usage; every
  event numbered (`sequence_number`).
- SGLang's `/generate` (`GenerateAnswer`): each event the text so far with its
  `meta_info`, the last with the finish reason and counts, then `[DONE]`; unary, the
  text and its `meta_info`.

A stream's events are built from a template made once per answer: no dict per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's logprob as the engine gave it, with the alternatives asked
    for (`top`, the engine's order: the sampled token first, then by rank)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """One choice once its sequence ended."""

    index: int
    text: str
    finish: str
    stop_reason: Any
    """The stop string, or the stop token id, that ended it (vLLM's `stop_reason`)."""
    logprobs: list[TokenLogprob] | None = None
    """Its tokens' logprobs not given out yet (a stream) or all of them (unary); None
    when the request asked for none."""


LOGPROB_FLOOR: Final = -9999.0
"""vLLM's OpenAI server writes no logprob below this (`-inf` is not JSON)."""


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _bytes_of(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`, as vLLM's chat server writes them."""
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": _floor(entry.logprob),
                "bytes": _bytes_of(entry.token),
                "top_logprobs": [
                    {"token": token, "logprob": _floor(logprob), "bytes": _bytes_of(token)}
                    for token, logprob in entry.top
                ],
            }
            for entry in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """A completions choice's `logprobs`, as vLLM's completions server writes them:
    `text_offset` counts from the characters of the choice given out before these
    tokens; each position's alternatives are keyed by their text (the sampled token
    alone when none were asked for)."""
    tokens: list[str] = []
    offsets: list[int] = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
        tokens.append(entry.token)
    return {
        "text_offset": offsets,
        "token_logprobs": [_floor(entry.logprob) for entry in entries],
        "tokens": tokens,
        "top_logprobs": [
            {token: _floor(logprob) for token, logprob in entry.top}
            if entry.top
            else {entry.token: _floor(entry.logprob)}
            for entry in entries
        ],
    }


class AnswerShapes(Protocol):
    def opening(self, n: int, prompt_tokens: int) -> bytes:
        """What a stream begins with, once the first token is in."""
        ...

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        """A choice's next text (with its tokens' logprobs, where the API carries them)."""
        ...

    def finish(self, done: Finished) -> bytes:
        """A choice's last text and its end."""
        ...

    def closing(self, usage: Usage, include_usage: bool) -> bytes:
        """What a whole stream ends with."""
        ...

    def unary(self, choices: list[Finished], usage: Usage) -> bytes: ...


def shapes_for(route: str, request_id: str, model: str) -> AnswerShapes:
    if route == "generate":
        return GenerateAnswer(request_id)
    if route == "messages":
        return AnthropicAnswer(request_id, model)
    if route == "responses":
        return ResponsesAnswer(request_id, model)
    return OpenAIAnswer(route, request_id, model)


def openai_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


DONE: Final = b"data: [DONE]\n\n"


class OpenAIAnswer:
    """Chat completions (`chat`) or completions, as vLLM writes them."""

    __slots__ = ("_chat", "_head", "_id", "_model", "_sent", "created")

    def __init__(self, route: str, request_id: str, model: str) -> None:
        self._chat = route == "chat"
        self._id = ("chatcmpl-" if self._chat else "cmpl-") + request_id
        self._model = model
        self._sent: dict[int, int] = {}  # per choice, the next `text_offset`
        self.created = int(time.time())  # the answer's timestamp: wall clock by definition
        kind = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = (
            b'data: {"id":'
            + orjson.dumps(self._id)
            + b',"object":"'
            + kind.encode()
            + b'","created":'
            + str(self.created).encode()
            + b',"model":'
            + orjson.dumps(model)
            + b',"choices":['
        )

    def opening(self, n: int, prompt_tokens: int) -> bytes:
        if not self._chat:
            return b""
        return b"".join(
            self._head
            + b'{"index":%d,"delta":{"role":"assistant","content":""},' % index
            + b'"logprobs":null,"finish_reason":null}]}\n\n'
            for index in range(n)
        )

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        tail = self._logprobs(index, text, logprobs) + b',"finish_reason":null'
        return self._chunk(index, text, tail)

    def finish(self, done: Finished) -> bytes:
        tail = self._logprobs(done.index, done.text, done.logprobs) + (
            b',"finish_reason":%s,"stop_reason":%s'
            % (orjson.dumps(done.finish), orjson.dumps(done.stop_reason))
        )
        return self._chunk(done.index, done.text, tail)

    def _logprobs(self, index: int, text: str, entries: list[TokenLogprob] | None) -> bytes:
        """The chunk's `logprobs` (`null` when none were asked for). Completions'
        `text_offset` goes on from the last chunk's tokens' texts, as vLLM counts it,
        not from the text given out (a token inside a character is "" there, and the
        text held back for a stop string is not given out yet)."""
        if entries is None:
            return b"null"
        if self._chat:
            return orjson.dumps(chat_logprobs(entries))
        offset = self._sent.get(index, 0)
        self._sent[index] = offset + sum(len(entry.token) for entry in entries)
        return orjson.dumps(completion_logprobs(entries, offset))

    def _chunk(self, index: int, text: str, tail: bytes) -> bytes:
        content = orjson.dumps(text)
        piece = b'"delta":{"content":%s}' % content if self._chat else b'"text":%s' % content
        return self._head + b'{"index":%d,%s,"logprobs":%s}]}\n\n' % (index, piece, tail)

    def closing(self, usage: Usage, include_usage: bool) -> bytes:
        if not include_usage:
            return DONE
        return self._head + b'],"usage":' + orjson.dumps(openai_usage(usage)) + b"}\n\n" + DONE

    def unary(self, choices: list[Finished], usage: Usage) -> bytes:
        return orjson.dumps(
            {
                "id": self._id,
                "object": "chat.completion" if self._chat else "text_completion",
                "created": self.created,
                "model": self._model,
                "choices": [self._choice(done) for done in sorted(choices, key=_index)],
                "usage": openai_usage(usage),
            }
        )

    def _choice(self, done: Finished) -> dict[str, Any]:
        entries = done.logprobs
        if self._chat:
            return {
                "index": done.index,
                "message": {"role": "assistant", "content": done.text, "tool_calls": []},
                "logprobs": None if entries is None else chat_logprobs(entries),
                "finish_reason": done.finish,
                "stop_reason": done.stop_reason,
            }
        return {
            "index": done.index,
            "text": done.text,
            "logprobs": None if entries is None else completion_logprobs(entries, 0),
            "finish_reason": done.finish,
            "stop_reason": done.stop_reason,
        }


def _index(done: Finished) -> int:
    return done.index


def anthropic_stop(done: Finished) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a finished sequence."""
    if done.finish == "length":
        return "max_tokens", None
    if isinstance(done.stop_reason, str):
        return "stop_sequence", done.stop_reason
    return "end_turn", None


def _event(name: bytes, payload: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class AnthropicAnswer:
    """Anthropic Messages: one text block per answer (Messages has no `n`)."""

    __slots__ = ("_id", "_model", "_stop")

    def __init__(self, request_id: str, model: str) -> None:
        self._id = "msg_" + request_id
        self._model = model
        self._stop: tuple[str, str | None] = ("end_turn", None)

    def opening(self, n: int, prompt_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return _event(b"message_start", {"type": "message_start", "message": message}) + _event(
            b"content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":%s}}\n\n' % orjson.dumps(text)
        )

    def finish(self, done: Finished) -> bytes:
        self._stop = anthropic_stop(done)
        out = self.delta(0, done.text) if done.text else b""
        return out + _event(b"content_block_stop", {"type": "content_block_stop", "index": 0})

    def closing(self, usage: Usage, include_usage: bool) -> bytes:
        stop_reason, stop_sequence = self._stop
        return _event(
            b"message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": usage.completion_tokens},
            },
        ) + _event(b"message_stop", {"type": "message_stop"})

    def unary(self, choices: list[Finished], usage: Usage) -> bytes:
        (done,) = choices
        stop_reason, stop_sequence = anthropic_stop(done)
        return orjson.dumps(
            {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "model": self._model,
                "content": [{"type": "text", "text": done.text}],
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {
                    "input_tokens": usage.prompt_tokens,
                    "output_tokens": usage.completion_tokens,
                    "cache_read_input_tokens": usage.cached_tokens,
                },
            }
        )


class ResponsesAnswer:
    """OpenAI Responses: one message item holding one `output_text` part (no `n`)."""

    __slots__ = ("_created", "_done", "_id", "_item", "_model", "_sequence", "_texts")

    def __init__(self, request_id: str, model: str) -> None:
        self._id = "resp_" + request_id
        self._item = "msg_" + request_id
        self._model = model
        self._created = int(time.time())  # the answer's timestamp: wall clock by definition
        self._sequence = 0
        self._done: Finished | None = None
        self._texts: list[str] = []

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: Usage | None
    ) -> dict[str, Any]:
        response: dict[str, Any] = {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "model": self._model,
            "output": output,
            "usage": None,
        }
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage is not None:
            response["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            }
        return response

    def _message(self, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        status = "in_progress" if text is None else "completed"
        return {
            "id": self._item,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def opening(self, n: int, prompt_tokens: int) -> bytes:
        response = self._response("in_progress", [], None)
        where = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return (
            self._event("response.created", {"response": response})
            + self._event("response.in_progress", {"response": response})
            + self._event(
                "response.output_item.added", {"output_index": 0, "item": self._message(None)}
            )
            + self._event("response.content_part.added", {**where, "part": self._part("")})
        )

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        self._texts.append(text)
        where = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return self._event("response.output_text.delta", {**where, "delta": text, "logprobs": []})

    def finish(self, done: Finished) -> bytes:
        self._done = done
        return self.delta(0, done.text) if done.text else b""

    def closing(self, usage: Usage, include_usage: bool) -> bytes:
        done = self._done
        assert done is not None
        text = "".join(self._texts)
        where = {"item_id": self._item, "output_index": 0, "content_index": 0}
        status = "incomplete" if done.finish == "length" else "completed"
        item = self._message(text)
        return (
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            + self._event("response.content_part.done", {**where, "part": self._part(text)})
            + self._event("response.output_item.done", {"output_index": 0, "item": item})
            + self._event(f"response.{status}", {"response": self._response(status, [item], usage)})
        )

    def unary(self, choices: list[Finished], usage: Usage) -> bytes:
        (done,) = choices
        status = "incomplete" if done.finish == "length" else "completed"
        return orjson.dumps(self._response(status, [self._message(done.text)], usage))


class GenerateAnswer:
    """SGLang's `/generate`: a stream carries the whole text so far in each event, as
    SGLang streams it by default."""

    __slots__ = ("_done", "_id", "_texts")

    def __init__(self, request_id: str) -> None:
        self._id = request_id
        self._texts: list[str] = []
        self._done: Finished | None = None

    def _meta(self, done: Finished | None, usage: Usage | None) -> dict[str, Any]:
        finish: dict[str, Any] | None = None
        if done is not None:
            if done.finish == "length":
                finish = {"type": "length", "length": usage.completion_tokens if usage else 0}
            else:
                finish = {"type": "stop", "matched": done.stop_reason}
        meta: dict[str, Any] = {"id": self._id, "finish_reason": finish}
        if usage is not None:
            meta |= {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.cached_tokens,
            }
        return meta

    def opening(self, n: int, prompt_tokens: int) -> bytes:
        return b""

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        self._texts.append(text)
        whole = "".join(self._texts)
        return (
            b"data: " + orjson.dumps({"text": whole, "meta_info": self._meta(None, None)}) + b"\n\n"
        )

    def finish(self, done: Finished) -> bytes:
        self._done = done
        self._texts.append(done.text)
        return b""

    def closing(self, usage: Usage, include_usage: bool) -> bytes:
        whole = "".join(self._texts)
        meta = self._meta(self._done, usage)
        return b"data: " + orjson.dumps({"text": whole, "meta_info": meta}) + b"\n\n" + DONE

    def unary(self, choices: list[Finished], usage: Usage) -> bytes:
        done = choices[0]
        return orjson.dumps({"text": done.text, "meta_info": self._meta(done, usage)})

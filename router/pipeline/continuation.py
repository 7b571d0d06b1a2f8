"""The client's stream after the seam: where a broken stream stopped, and the continuation
another worker streams, turned into the rest of the client's stream.

`open_seam` looks at what the broken stream gave the client (`StreamCapture`) and either
refuses (`Refusal`) or opens a `Seam`: the router's own detokenizer (`StreamedText`,
primed with the prompt's ids) is fed every generated id, and its text must be the text
the client got, but for what an engine holds back while it waits to see whether a stop
string begins there. From then on the router makes the text.

`ContinuationRelay` reads the continuation's events (token ids; its text is never used:
vLLM #48853) and writes the client's: the original stream's `id`, `created` and `model`,
the router's text, ids only if the client asked for them, stop strings checked across the
seam (the continuation is sent without them), and one final `usage` counting the
original prompt and every generated token. The role event a chat continuation starts
with is dropped: the client had its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from router.pipeline.resume import Refusal, token_limit
from router.pipeline.stream_capture import GarbledEvent, StreamCapture, max_event_bytes
from router.prompts.detokenize import StreamedText
from router.prompts.tokenizer import TextTokenizer

__all__ = ["ContinuationRelay", "Seam", "open_seam"]

_DATA: Final = b"data: "
DONE_EVENT: Final = b"data: [DONE]\n\n"


class Seam:
    """A broken stream's state, carried from one worker to the next: the prompt's ids and
    every id generated so far, the text made of them, and the shape of its events."""

    __slots__ = (
        "client_ids",
        "created",
        "generated",
        "include_usage",
        "limit",
        "model",
        "object",
        "prompt_ids",
        "response_id",
        "resumes",
        "route",
        "template",
        "text",
    )

    def __init__(
        self,
        capture: StreamCapture,
        text: StreamedText,
        route: str,
        body: Mapping[str, Any],
    ) -> None:
        assert capture.prompt_ids is not None and capture.last_event is not None
        self.route = route
        self.prompt_ids = list(capture.prompt_ids)
        self.generated = list(capture.generated)
        self.text = text
        self.limit = token_limit(route, body)
        template = capture.last_event
        self.template = template
        self.response_id = capture.response_id
        self.created = capture.created
        self.model = capture.model
        self.object = template.get("object")
        options = body.get("stream_options")
        self.include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        self.client_ids = body.get("return_token_ids") is True
        self.resumes = 0

    @property
    def budget_left(self) -> int | None:
        """Tokens the continuation may still generate; None: the engine's own default."""
        return None if self.limit is None else self.limit - len(self.generated)

    def usage(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The whole answer's counts: the original prompt and every generated token (what
        the continuation reports of its longer prompt is not the client's)."""
        usage = {k: v for k, v in (base or {}).items() if k != "prompt_tokens_details"}
        prompt, completion = len(self.prompt_ids), self.text.tokens
        usage.update(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        return usage

    def event(self, chunk: dict[str, Any]) -> bytes:
        """`chunk` as the client's event: the original stream's identity."""
        chunk["id"] = self.response_id
        chunk["created"] = self.created
        chunk["model"] = self.model
        return _DATA + orjson.dumps(chunk) + b"\n\n"

    def ending(self, finish_reason: str | None = None, stop_reason: str | None = None) -> bytes:
        """The events that end the client's stream when the router ends it: a finish event
        (when `finish_reason`, with the text still held back), the usage event if the
        client asked for it, `[DONE]`."""
        out = b""
        if finish_reason is not None:
            out += self.event(
                self.choice_event(
                    self.template, self.text.take(finished=True), finish_reason, stop_reason, []
                )
            )
        if self.include_usage:
            out += self.event(
                {"id": None, "object": self.object, "created": None, "model": None, "choices": []}
                | {"usage": self.usage()}
            )
        return out + DONE_EVENT

    def choice_event(
        self,
        chunk: Mapping[str, Any],
        text: str,
        finish_reason: Any,
        stop_reason: Any,
        ids: list[int],
    ) -> dict[str, Any]:
        """`chunk` (one choice) carrying the router's `text` and the given ending."""
        out = dict(chunk)
        out.pop("prompt_token_ids", None)
        out.pop("usage", None)
        choice = dict(chunk["choices"][0])
        if "delta" in choice or self.route == "chat":
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
        if "token_ids" in choice or self.client_ids:
            choice["token_ids"] = ids if self.client_ids else None
        choice["finish_reason"] = finish_reason
        if "stop_reason" in choice or stop_reason is not None:
            choice["stop_reason"] = stop_reason
        out["choices"] = [choice]
        return out


def open_seam(
    capture: StreamCapture,
    tokenizer: TextTokenizer | None,
    route: str,
    body: Mapping[str, Any],
) -> Seam | Refusal:
    """A seam for the stream `capture` relayed, or why there can be none."""
    if capture.unresumable is not None:
        return capture.unresumable
    if capture.prompt_ids is None or capture.last_event is None:
        return Refusal.NO_IDS
    if tokenizer is None:
        return Refusal.NO_TOKENIZER
    stops = body.get("stop")
    if isinstance(stops, str):
        stops = [stops]
    min_tokens = body.get("min_tokens")
    text = StreamedText(
        tokenizer.decode_stream(
            capture.prompt_ids, skip_special_tokens=body.get("skip_special_tokens") is not False
        ),
        stops=[s for s in stops if isinstance(s, str)] if isinstance(stops, list) else (),
        include_stop=body.get("include_stop_str_in_output") is True,
        min_tokens=min_tokens if isinstance(min_tokens, int) else 0,
    )
    for token in capture.generated:
        if text.stopped_by is not None:
            return Refusal.HELD_BACK  # a stop string the engine would have ended on
        text.push(token)
    if not text.seam(capture.text):
        return Refusal.HELD_BACK
    return Seam(capture, text, route, body)


class ContinuationRelay:
    """Turns a continuation's events into the client's (the relay's event filter).

    `complete` once the client's stream has its end (`[DONE]`): the continuation's, or the
    router's own when a stop string completes across the seam, after which nothing more is
    read from the worker (closing the connection ends its generation).
    """

    __slots__ = ("complete", "seam")

    def __init__(self, seam: Seam) -> None:
        self.seam = seam
        self.complete = False

    @property
    def max_event_bytes(self) -> int:
        return max_event_bytes(len(self.seam.prompt_ids) + len(self.seam.generated))

    def feed(self, events: bytes) -> bytes:
        """The client's bytes for whole continuation `events`; GarbledEvent for an event
        that is not JSON, or a token without ids."""
        out: list[bytes] = []
        start = 0
        while start < len(events) and not self.complete:
            end = events.find(b"\n\n", start)
            if end < 0:
                end = len(events)
            piece = self._event(events[start:end].strip())
            if piece:
                out.append(piece)
            start = end + 2
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA):
            return b""
        payload = event[len(_DATA) :]
        seam = self.seam
        if payload == b"[DONE]":
            self.complete = True
            return DONE_EVENT
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise GarbledEvent("an event of the continuation is not JSON") from None
        if not isinstance(chunk, dict):
            raise GarbledEvent("an event of the continuation is not a JSON object")
        choices = chunk.get("choices")
        if not choices:
            if isinstance(chunk.get("usage"), Mapping):
                chunk["usage"] = seam.usage(chunk["usage"])
                chunk.pop("prompt_token_ids", None)
                return seam.event(chunk)
            return event + b"\n\n"  # the engine's own error event: the client's to read
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids is None:
            delta = choice.get("delta")
            if isinstance(delta, Mapping) and "role" in delta:
                return b""  # the continuation's role event: the client had its own
            raise GarbledEvent("the continuation sent a token without its id")
        finish = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        text = seam.text
        taken: list[int] = []
        for index, token in enumerate(ids):
            taken.append(token)
            seam.generated.append(token)
            if finish == "stop" and index == len(ids) - 1 and not isinstance(stop_reason, str):
                text.push_stop_token(token)  # end of sequence, or one of `stop_token_ids`
            else:
                text.push(token)
            if text.stopped_by is not None:
                break
        if text.stopped_by is not None:
            finish, stop_reason = "stop", text.stopped_by
        delta = text.take(finished=finish is not None)
        out = seam.event(seam.choice_event(chunk, delta, finish, stop_reason, taken))
        if text.stopped_by is not None:
            # The continuation was sent without stop strings: the router ends the stream.
            self.complete = True
            out += seam.ending()
        return out

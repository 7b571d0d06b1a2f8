"""What a relayed stream has given its client, in token ids and text, kept while relaying so
the generation can go on elsewhere if its worker breaks.

A stream in the resume envelope (`router.pipeline.resume`) asks a vLLM engine for its
token ids (`return_token_ids`): the prompt's on the first event (`prompt_token_ids`: at
the top of a chat event, in the choice of a completions one) and each event's own ids
(`choices[0].token_ids`). `StreamCapture.feed` takes every complete event the relay is
about to send, keeps the ids and the text the client gets with them, and gives back the
bytes to send: the same events with both id arrays written `null`, exactly as the engine
writes them when nobody asks for ids, unless the client asked for them itself.

Each event is parsed once (orjson); the ids are cut out of the bytes, never re-serialised,
so the client gets the engine's own bytes. What a resume could not account for is noted
as it passes (`unresumable`): a tool call or reasoning in the answer, text without ids,
more ids than `max_ids`. The cost per event is measured in docs/performance.md ("Stream
resume: capture while relaying").
"""

from __future__ import annotations

from array import array
from typing import Any, Final

import orjson

from router.pipeline.relay import MAX_PENDING_BYTES
from router.pipeline.resume import Refusal

__all__ = ["GarbledEvent", "StreamCapture", "max_event_bytes", "null_id_arrays"]

_DATA: Final = b"data: "
_DONE: Final = b"[DONE]"
_IDS_KEY: Final = b'token_ids":['
"""The end of both keys whose arrays are cut: `"token_ids"` and `"prompt_token_ids"`."""
ID_BYTES: Final = 12
"""Room per id when an event carries a prompt's ids: digits, a comma, to spare."""


def max_event_bytes(max_ids: int) -> int:
    """How large an event a resumable stream must see whole: an ordinary event's bound
    plus room for `max_ids` ids (the prompt's, on the first event)."""
    return MAX_PENDING_BYTES + ID_BYTES * max_ids


class GarbledEvent(Exception):
    """An event of the stream is not what the engine sends (not JSON, or not an object)."""


def null_id_arrays(data: bytes) -> bytes:
    """`data` with every `"token_ids": [...]` and `"prompt_token_ids": [...]` array written
    `null`. Only a key can be followed by `":[` (a quote inside a JSON string is escaped),
    and an array of ids holds no `]` before its own. One scan of the bytes for both keys."""
    found = data.find(_IDS_KEY)
    if found < 0:
        return data
    parts: list[bytes] = []
    position = 0
    while found >= 0:
        value = found + len(_IDS_KEY) - 1
        end = data.index(b"]", value) + 1
        if data[found - 1 : found] == b'"' or data[found - 8 : found] == b'"prompt_':
            parts.append(data[position:value])
            parts.append(b"null")
            position = end
        found = data.find(_IDS_KEY, end)
    parts.append(data[position:])
    return b"".join(parts)


class StreamCapture:
    """The ids and text one relayed stream (one sequence: n = 1) has given its client.

    `strip`: the client did not ask for ids, so they are cut out before it sees them.
    Past `max_ids` (prompt and generated together) nothing more is kept: the stream is
    then `unresumable`, and what was kept is dropped.
    """

    __slots__ = (
        "_room",
        "created",
        "done",
        "finish_reason",
        "generated",
        "last_event",
        "max_ids",
        "model",
        "prompt_ids",
        "response_id",
        "strip",
        "texts",
        "unresumable",
    )

    def __init__(self, *, strip: bool, max_ids: int) -> None:
        self.strip = strip
        self.max_ids = max_ids
        self.prompt_ids: array[int] | None = None
        self.generated: array[int] = array("q")
        self.texts: list[str] = []
        """The text of each event, as the client got it."""
        self.response_id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.finish_reason: str | None = None
        self.done = False
        """`[DONE]` went by: the stream is whole."""
        self.last_event: dict[str, Any] | None = None
        """The last event with a choice, parsed: the shape a router-made event copies."""
        self.unresumable: Refusal | None = None
        self._room = max_ids
        """Ids that may still be kept."""

    @property
    def complete(self) -> bool:
        """The stream reached its end marker: nothing after it matters."""
        return self.done

    @property
    def max_event_bytes(self) -> int:
        return max_event_bytes(self.max_ids)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def feed(self, events: bytes) -> bytes:
        """Keep what `events` (whole events) carry; return the bytes the client gets.
        Raises GarbledEvent for a data event that is not a JSON object."""
        start = 0
        end = events.find(b"\n\n")
        while end >= 0:
            self._event(events[start:end])
            start = end + 2
            end = events.find(b"\n\n", start)
        if start < len(events):
            self._event(events[start:])
        return null_id_arrays(events) if self.strip else events

    def _event(self, event: bytes) -> None:
        if not event.startswith(_DATA):
            event = event.strip()
            if not event.startswith(_DATA):
                return  # a comment, an `event:` line of its own, a stray blank line
        payload = event[6:]
        if payload == _DONE:
            self.done = True
            return
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise GarbledEvent("an event of the stream is not JSON") from None
        if type(chunk) is not dict:
            raise GarbledEvent("an event of the stream is not a JSON object")
        choices = chunk.get("choices")
        if not choices:
            return  # the usage event, or an engine's error event
        self.last_event = chunk
        choice = choices[0]
        delta = choice.get("delta")
        if delta is not None:
            text = delta.get("content")
            if len(delta) > 1 or text is None:
                # More than the content (the role event, a tool call, reasoning).
                if delta.get("tool_calls"):
                    self._refuse(Refusal.TOOL_CALL_OPEN)
                if delta.get("reasoning") or delta.get("reasoning_content"):
                    self._refuse(Refusal.REASONING_OPEN)
        else:
            text = choice.get("text")
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finish_reason = finish
        if self.unresumable is not None:
            return
        if self.prompt_ids is None:
            self.response_id = chunk.get("id")
            self.created = chunk.get("created")
            self.model = chunk.get("model")
            prompt_ids = chunk.get("prompt_token_ids") or choice.get("prompt_token_ids")
            if prompt_ids:
                self.prompt_ids = array("q", prompt_ids)
                self._room -= len(prompt_ids)
        ids = choice.get("token_ids")
        if ids is None:
            if text:
                self._refuse(Refusal.NO_IDS)
            return
        self.generated.extend(ids)
        if text:
            self.texts.append(text)
        self._room -= len(ids)
        if self._room < 0:
            self._refuse(Refusal.IDS_BOUND)

    def _refuse(self, reason: Refusal) -> None:
        if self.unresumable is None:
            self.unresumable = reason
            # Nothing kept is of use any more.
            self.prompt_ids = None
            self.generated = array("q")
            self.texts = []

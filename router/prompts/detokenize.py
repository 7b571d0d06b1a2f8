"""The text of generated token ids, made here the way an engine makes it while it streams.

A stream that resumes on another worker goes on with text the router makes from the token
ids the continuation streams, never with the continuation's own text: a vLLM engine given
a prompt of ids re-emits part of that prompt as text in its first delta whenever the ids
before the seam do not end on a clean character boundary (vLLM #48853), so its text
cannot be trusted at the seam. `StreamedText` follows vLLM's incremental detokenizer
(`vllm/v1/engine/detokenizer.py`, the fast path over `tokenizers`' `DecodeStream`,
primed with the prompt's ids) step for step:

- each id is decoded as it comes; an id that ends inside a multi-byte character gives
  no text until the character completes;
- stop strings are looked for in the new text (and the few characters before it that a
  stop string could span), only once more than `min_tokens` ids were generated; the text
  is cut before the stop string (or after it, with `include_stop_str_in_output`), and ids
  after the one that completed it do not count;
- while the sequence runs, the last `len(longest stop) - 1` characters are held back
  (they could begin a stop string), and given out once it ends;
- the id that ends a sequence on a stop token (end of sequence, `stop_token_ids`) is
  counted but not decoded, unless `include_stop_str_in_output`.

docs/failover-and-breaker.md ("After the first byte") says how it was held to a real
engine's streamed text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["DecodeStep", "StreamedText", "find_stop"]

DecodeStep = Callable[[int], "str | None"]
"""One id in, the text it completes out (None while a character is incomplete)."""


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string that completes earliest in the last `new_chars` characters of
    `text` (a stop string may begin before them), and where it begins; None when none
    does. Ties go to the first in `stops`, as vLLM's `check_stop_strings` decides."""
    if not new_chars or not stops:
        return None
    best: tuple[str, int] | None = None
    best_end = len(text) + 1
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start < 0:
            continue
        end = start + len(stop)
        if end < best_end:
            best, best_end = (stop, start), end
    return best


class StreamedText:
    """The text of one sequence's generated ids, given out as the engine gives it out.

    `push` each id in order; `take` what may go to the client now. After a stop string
    completed, `stopped_by` names it and further ids are refused (the sequence is over).
    """

    __slots__ = (
        "_buffer",
        "_include_stop",
        "_min_tokens",
        "_sent",
        "_step",
        "_stops",
        "stopped_by",
        "text",
        "tokens",
    )

    def __init__(
        self,
        step: DecodeStep,
        *,
        stops: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._step = step
        self._stops = tuple(s for s in stops if s)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._buffer = (
            max(len(s) for s in self._stops) - 1 if self._stops and not include_stop else 0
        )
        self._sent = 0
        self.text = ""
        """Every character made so far (cut at a stop string once one completed)."""
        self.tokens = 0
        """Ids counted so far: what `usage.completion_tokens` says of this sequence."""
        self.stopped_by: str | None = None

    @property
    def sent(self) -> int:
        """Characters given out by `take` (or taken as given out by `seam`)."""
        return self._sent

    def push(self, token_id: int, *, decode: bool = True) -> None:
        """Count one id and decode it (`decode=False`: the stop token that ends the
        sequence, counted, never shown). Raises ValueError after a stop string."""
        if self.stopped_by is not None:
            raise ValueError("the sequence already ended at a stop string")
        self.tokens += 1
        if not decode:
            return
        piece = self._step(token_id)
        if not piece:
            return
        self.text += piece
        if not self._stops or self.tokens <= self._min_tokens:
            return
        found = find_stop(self.text, len(piece), self._stops)
        if found is None:
            return
        stop, start = found
        self.stopped_by = stop
        self.text = self.text[: start + len(stop)] if self._include_stop else self.text[:start]

    def push_stop_token(self, token_id: int) -> None:
        """The id that ended the sequence on a stop token (end of sequence or one of
        `stop_token_ids`): counted, and shown only with `include_stop_str_in_output`."""
        self.push(token_id, decode=self._include_stop)

    @property
    def held(self) -> int:
        """Characters made but held back while the sequence runs (a stop string could
        begin there)."""
        return min(self._buffer, len(self.text))

    def take(self, *, finished: bool = False) -> str:
        """The text made since the last `take` that may go out now: all of it once the
        sequence is `finished` (or stopped), else all but the held-back characters."""
        if finished or self.stopped_by is not None:
            end = len(self.text)
        else:
            end = len(self.text) - self._buffer
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def seam(self, received: str) -> bool:
        """Whether `received`, the text a client got for the ids pushed so far, is what
        this would have given out by now (all but the held-back characters); if so, go on
        from there. False: the client got text these ids do not account for."""
        end = max(0, len(self.text) - self._buffer)
        if self.stopped_by is not None or self.text[:end] != received:
            return False
        self._sent = end
        return True

"""One request's resume: whether its stream may go on elsewhere, what each attempt relays
it through, and what a break comes to.

Built once per streamed generation request by the attempt loop. Before each attempt the
runner asks `prepare` for the body to send and the filter to relay through: nothing at
all for a stream that cannot resume (the relay costs what it always did), a
`StreamCapture` (and `return_token_ids` added to the body) for a first attempt in the
envelope on a vLLM worker, a `ContinuationRelay` once the stream broke and goes on. After
a break, `decide` opens the seam or says why not. Synchronous: the attempt loop does the
I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from router.fleet.registry import Worker
from router.pipeline.continuation import ContinuationRelay, Seam, open_seam
from router.pipeline.dispatch import EventFilter, StreamBroken
from router.pipeline.handoff_body import UnspliceableBody, splice_handoff
from router.pipeline.resolve import GenerationRequest
from router.pipeline.resume import Refusal, ResumeSettings, envelope
from router.pipeline.stream_capture import StreamCapture
from router.prompts.tokenizer import TextTokenizer

__all__ = ["RequestResume"]

ASKS_IDS: Final = frozenset({"vllm"})
"""Engines asked for token ids: vLLM streams them for chat and completions. SGLang's
chat refuses the field when streaming, and an engine of unknown kind is never sent one."""


class RequestResume:
    """The resume of one streamed generation request."""

    __slots__ = (
        "_tokenizer",
        "_tokenizer_model",
        "_tokenizers",
        "broken",
        "capture",
        "ended_broken",
        "generation",
        "seam",
        "settings",
        "why_not",
    )

    def __init__(
        self,
        settings: ResumeSettings,
        generation: GenerationRequest,
        tokenizers: Callable[[str], TextTokenizer | None],
        opt_out: bytes | None = None,
    ) -> None:
        """`opt_out`: the request's `X-Router-Resume` header (`off` turns resume off)."""
        self.settings = settings
        self.generation = generation
        """The client's request (a continuation's body is built from it)."""
        self.capture: StreamCapture | None = None
        self.seam: Seam | None = None
        self._tokenizers = tokenizers
        self._tokenizer: TextTokenizer | None = None
        self._tokenizer_model: str | None = None
        self.why_not: Refusal | None = None
        """Why this request's stream cannot resume whatever its worker (decided before its
        first attempt); a model without a local tokenizer is found per attempt."""
        self.ended_broken = False
        """A stream relayed without a filter broke (it ended with the error event)."""
        self.broken: StreamBroken | None = None
        """How the stream last broke (the error event it ends with if nothing goes on)."""
        if not settings.enabled(generation.route) or (
            opt_out is not None and opt_out.strip().lower() in (b"off", b"0", b"false", b"no")
        ):
            self.why_not = Refusal.DISABLED
            return
        self.why_not = envelope(generation.route, generation.body)

    def _tokenizer_now(self) -> TextTokenizer | None:
        """The local tokenizer of the model the request is planned for now (a fallback
        changes it: `generation` is the request the attempt loop plans), looked up once per
        model. Without one the router has nothing to make the text with: no ids asked."""
        model = self.generation.model
        if model != self._tokenizer_model:
            self._tokenizer_model = model
            self._tokenizer = self._tokenizers(model)
        return self._tokenizer

    def why_relayed_plain(self) -> Refusal:
        """Why a stream relayed without a filter (`ended_broken`) was not resumed."""
        if self.why_not is not None:
            return self.why_not
        return Refusal.NO_TOKENIZER if self._tokenizer is None else Refusal.NO_IDS

    def prepare(self, worker: Worker, body: bytes) -> tuple[bytes, EventFilter | None]:
        """The body to send `worker` for this attempt and the filter to relay its stream
        through (None: relayed as it comes)."""
        if self.seam is not None:
            return body, ContinuationRelay(self.seam)
        self.capture = None
        if self.why_not is not None or self._tokenizer_now() is None:
            return body, None
        if worker.engine not in ASKS_IDS:
            return body, None
        generation = self.generation
        client_ids = generation.body.get("return_token_ids") is True
        if not client_ids:
            try:
                body = splice_handoff(body, generation.body, {"return_token_ids": True})
            except UnspliceableBody:
                return body, None
        self.capture = StreamCapture(strip=not client_ids, max_ids=self.settings.max_ids)
        return body, self.capture

    def decide(self, worker: Worker) -> Seam | Refusal:
        """After `worker`'s stream broke: the seam to go on from, or why the stream ends."""
        seam = self.seam
        if seam is None:
            if self.why_not is not None:
                return self.why_not
            capture = self.capture
            if capture is None:
                # Nothing to make the text with, or a worker whose engine is not asked for ids.
                return self.why_relayed_plain()
            opened = open_seam(
                capture, self._tokenizer, self.generation.route, self.generation.body
            )
            if isinstance(opened, Refusal):
                return opened
            seam = self.seam = opened
        if seam.resumes >= self.settings.limit:
            return Refusal.LIMIT
        return seam

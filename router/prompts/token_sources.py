"""Where `kv_aware` gets a request's token ids, per model: a chain of sources, tried in
order, and said out loud.

1. `tokenizer`: the operator's `--kv-tokenizer` (a `tokenizer.json` or the model's
   directory), for every model;
2. `model_dir`: the directory the engine reports it loaded the model from (vLLM's
   `/v1/models` `root`), when this process can read it: loaded here once, and checked
   against the engine's own `/tokenize` on a probe text, so a path that exists here but
   holds another model is never used;
3. `engine`: the engine's own `/tokenize`, asked per request by the pipeline
   (`router.pipeline.engine_tokens`) when the local sources cannot give the ids (no local
   tokenizer, or a request shape the local renderer does not reproduce): exact by
   construction, at a round trip's cost;
4. none: the request is placed by load alone, counted by reason.

The first two are the local fast path; the engine is asked only for what they cannot do.
`--kv-token-sources` chooses and orders the sources (default all three, in this order).
The chain for each model is decided when the fleet changes (a model's workers, their
engine kinds and directories), logged once at start and on every change
(`kv_aware for tiny: token ids from the engine's /tokenize`), with a warning for a model
left with none; `/metrics` labels each model with its first source. Chains kept only for
resumed streams (`for_resume_only`: no `kv_aware` leg) say so, at INFO whatever they hold.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from router.fleet.registry import Fleet, Worker
from router.prompts.tokenize_request import BadTokens, read_tokens
from router.prompts.tokenizer import HfTokenizer, TextTokenizer

log = logging.getLogger("router.token_sources")

PROBE_TEXT = "A router's probe: 1, 2, 3 — naïve café, 東京, emoji 🙂.\nEnd"
"""Text both tokenizers must split alike before a model directory read here is trusted:
digits, punctuation, accents, CJK, an emoji and a newline."""

ENGINES_THAT_TOKENIZE = frozenset({"vllm", "sglang"})


class TokenSource(enum.StrEnum):
    TOKENIZER = "tokenizer"
    MODEL_DIR = "model_dir"
    ENGINE = "engine"
    NONE = "none"


DEFAULT_ORDER = (TokenSource.TOKENIZER, TokenSource.MODEL_DIR, TokenSource.ENGINE)


def parse_order(text: str) -> tuple[TokenSource, ...]:
    """`--kv-token-sources`: comma-separated source names; ValueError for an unknown or
    repeated one, or none at all."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [s.value for s in DEFAULT_ORDER]
    order: list[TokenSource] = []
    for name in names:
        if name not in known:
            raise ValueError(f"unknown token source {name!r}: choose from {', '.join(known)}")
        if TokenSource(name) in order:
            raise ValueError(f"token source {name!r} is listed twice")
        order.append(TokenSource(name))
    if not order:
        raise ValueError(f"name at least one token source of {', '.join(known)}")
    return tuple(order)


@dataclass(frozen=True, slots=True)
class TokenSourceSettings:
    order: tuple[TokenSource, ...] = DEFAULT_ORDER
    operator_path: str = ""
    """The operator's `--kv-tokenizer`, as given (for the log line)."""
    reconcile_s: float = 0.2
    """How often the fleet's change counter is read (an integer compare when nothing
    changed) to decide the chains again."""
    probe_timeout_s: float = 5.0
    worker_api_key: str = field(default="", repr=False)
    for_resume_only: bool = False
    """The chains serve only a broken stream's continuation (the text after its seam), not
    `kv_aware`: the log lines say so, and a model with no tokenizer is said at INFO (its
    streams end with the error event when they break, as without resume)."""


@dataclass(frozen=True, slots=True)
class ModelChain:
    """One model's sources: the local tokenizer (operator's or a model directory read
    here) if any, whether its engines may be asked, and how to say so."""

    local: TextTokenizer | None
    local_source: TokenSource | None
    local_detail: str
    engine: bool

    @property
    def first(self) -> TokenSource:
        if self.local_source is not None:
            return self.local_source
        return TokenSource.ENGINE if self.engine else TokenSource.NONE

    def describe_local(self) -> str | None:
        """The local tokenizer's origin, for a log line; None without one."""
        if self.local_source is TokenSource.TOKENIZER:
            return f"--kv-tokenizer {self.local_detail}"
        if self.local_source is TokenSource.MODEL_DIR:
            return f"the engine's model directory {self.local_detail}, read here"
        return None

    def describe(self) -> str:
        local = self.describe_local()
        parts = [] if local is None else [local]
        if self.engine:
            parts.append("the engine's /tokenize" + (" for the rest" if parts else ""))
        return "token ids from " + ", then ".join(parts) if parts else "no source of token ids"


NO_CHAIN = ModelChain(None, None, "", False)


def tokenizing_workers(workers: Iterable[Worker]) -> list[Worker]:
    """The workers whose engine answers `/tokenize` (vLLM renders chat too; SGLang takes a
    prompt only)."""
    return [w for w in workers if w.engine in ENGINES_THAT_TOKENIZE]


class TokenSources:
    """The chain of every served model; `chain(model)` is read per request."""

    def __init__(
        self, fleet: Fleet, settings: TokenSourceSettings, operator: TextTokenizer | None = None
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.operator = operator
        self._chains: dict[str, ModelChain] = {}
        self._dirs: dict[str, HfTokenizer | str] = {}
        """Model directories looked at: the tokenizer read there, or why it is not used."""
        self._seen_generation = -1

    def chain(self, model: str) -> ModelChain:
        chain = self._chains.get(model)
        if chain is not None:
            return chain
        # Before the first reconcile (or a model not decided yet): the operator's alone.
        if self.operator is not None and TokenSource.TOKENIZER in self.settings.order:
            return ModelChain(
                self.operator, TokenSource.TOKENIZER, self.settings.operator_path, False
            )
        return NO_CHAIN

    def local(self, model: str) -> TextTokenizer | None:
        return self.chain(model).local

    def sources(self) -> dict[str, TokenSource]:
        """Each decided model's first source (the metric's label)."""
        return {model: chain.first for model, chain in self._chains.items()}

    async def reconcile(self, http: httpx.AsyncClient) -> None:
        """Decide the chain of every served model again if the fleet changed; log each
        change. Reads model directories (in a thread) and probes engines, so it may take a
        while; requests meanwhile read the chains as they were."""
        generation = self.fleet.generation
        if generation == self._seen_generation:
            return
        self._seen_generation = generation
        models = self.fleet.models()
        for model in models:
            chain = await self._decide(model, self.fleet.for_model(model), http)
            before = self._chains.get(model)
            self._chains[model] = chain
            if before is None or before.describe() != chain.describe():
                self._say(model, chain)
        for model in [m for m in self._chains if m not in models]:
            del self._chains[model]

    def _say(self, model: str, chain: ModelChain) -> None:
        if not self.settings.for_resume_only:
            if chain.first is TokenSource.NONE:
                log.warning(
                    "kv_aware for %s: no source of token ids (no --kv-tokenizer, no model "
                    "directory readable here, no engine that answers /tokenize): its "
                    "requests are placed by load alone",
                    model,
                )
            else:
                log.info("kv_aware for %s: %s", model, chain.describe())
        else:
            local = chain.describe_local()
            if local is None:
                log.info(
                    "resume for %s: no tokenizer here (no --kv-tokenizer, no model directory "
                    "readable here): a stream that breaks ends with the error event",
                    model,
                )
            else:
                log.info("resume for %s: the text after a seam made with %s", model, local)

    async def _decide(
        self, model: str, workers: Sequence[Worker], http: httpx.AsyncClient
    ) -> ModelChain:
        order = self.settings.order
        engine = TokenSource.ENGINE in order and bool(tokenizing_workers(workers))
        for source in order:
            if source is TokenSource.TOKENIZER and self.operator is not None:
                return ModelChain(self.operator, source, self.settings.operator_path, engine)
            if source is TokenSource.MODEL_DIR:
                found = await self._model_dir(model, workers, http)
                if found is not None:
                    root, tokenizer = found
                    return ModelChain(tokenizer, source, root, engine)
            if source is TokenSource.ENGINE and engine:
                break
        return ModelChain(None, None, "", engine)

    async def _model_dir(
        self, model: str, workers: Sequence[Worker], http: httpx.AsyncClient
    ) -> tuple[str, HfTokenizer] | None:
        roots = sorted(
            {w.record.model_roots[model] for w in workers if model in w.record.model_roots}
        )
        for root in roots:
            verdict = self._dirs.get(root)
            if verdict is None:
                verdict = await self._read_dir(root, model, workers, http)
                if isinstance(verdict, str):
                    log.info(
                        "kv_aware for %s: model directory %s not used: %s", model, root, verdict
                    )
                # A verdict that depended on an engine answering is asked again next time.
                if not (isinstance(verdict, str) and verdict.startswith("unchecked")):
                    self._dirs[root] = verdict
            if isinstance(verdict, HfTokenizer):
                return root, verdict
        return None

    async def _read_dir(
        self, root: str, model: str, workers: Sequence[Worker], http: httpx.AsyncClient
    ) -> HfTokenizer | str:
        path = Path(root)
        if not await trio.to_thread.run_sync(_readable_model_dir, path):
            return "not readable here"
        try:
            tokenizer = await trio.to_thread.run_sync(HfTokenizer, root)
        except ValueError as exc:
            return str(exc)
        expected = await self._probe(model, workers, http)
        if expected is None:
            return "unchecked: no engine of the model answered the probe"
        got = tokenizer.encode(PROBE_TEXT)
        if got != expected:
            return (
                f"it holds another tokenizer than the engine's ({len(got)} probe tokens here, "
                f"{len(expected)} from the engine)"
            )
        return tokenizer

    async def _probe(
        self, model: str, workers: Sequence[Worker], http: httpx.AsyncClient
    ) -> list[int] | None:
        """The engine's ids for `PROBE_TEXT` as a completions prompt, from the first
        tokenizing worker that answers; None when none does."""
        for worker in tokenizing_workers(workers):
            key = worker.record.api_key or self.settings.worker_api_key
            headers = {"authorization": f"Bearer {key}"} if key else None
            body = {"model": model, "prompt": PROBE_TEXT, "add_special_tokens": True}
            try:
                answer = await http.post(
                    worker.url + "/tokenize",
                    json=body,
                    headers=headers,
                    timeout=self.settings.probe_timeout_s,
                )
                if answer.status_code == 200:
                    return read_tokens(answer.content)
            except (httpx.HTTPError, BadTokens):
                continue
        return None


def _readable_model_dir(path: Path) -> bool:
    try:
        return path.is_dir() and (path / "tokenizer.json").is_file()
    except OSError:
        return False


async def serve_token_sources(
    sources: TokenSources,
    http: httpx.AsyncClient,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep every model's chain current until cancelled; reports `started()` once the fleet
    as it is was decided (its first log lines written).

    Cancellation: nothing is left behind; the chains decided stay readable.
    """
    await sources.reconcile(http)
    task_status.started()
    while True:
        await trio.sleep(sources.settings.reconcile_s)
        await sources.reconcile(http)

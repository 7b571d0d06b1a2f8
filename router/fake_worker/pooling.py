"""The non-generation routes of a fake engine, as data: embeddings, rerank, score, classify,
pooling, tokenize and detokenize, each in its engine's format (`--engine`).

Every answer is deterministic: a text's vector is derived from its bytes (equal inputs,
equal vectors; `--embedding-dim` floats, unit length), a score from the pair of texts.
Usage counts are honest for the fake tokenizer (one token per whitespace-separated word;
a word's id is derived from its bytes, and id `k` detokenizes to `tok{k}`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.fake_worker.formats import BadGenerationRequest, count_words
from router.fake_worker.vocabulary import word_ids

if TYPE_CHECKING:
    from router.fake_worker.model_tokens import ModelTokens

MAX_MODEL_LEN = 32_768
MAX_INPUTS = 4096


@dataclass(frozen=True, slots=True)
class PoolingContext:
    model: str
    engine: str
    embedding_dim: int
    request_id: str
    created: int
    max_model_len: int = MAX_MODEL_LEN  # vLLM's, from `--max-model-len`; SGLang's is fixed
    model_tokens: ModelTokens | None = None
    """With `--tokenizer`: `/tokenize` answers in the model's tokens, as the engine would."""


def vector(text: str, dim: int) -> list[float]:
    """A unit vector of `dim` floats derived from `text` alone."""
    values: list[float] = []
    counter = 0
    seed = text.encode("utf-8", "surrogatepass")
    while len(values) < dim:
        digest = hashlib.blake2b(
            seed, digest_size=64, person=counter.to_bytes(8, "little")
        ).digest()
        values.extend(x / 2**31 for x in struct.unpack("<16i", digest))
        counter += 1
    values = values[:dim]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]


def similarity(a: str, b: str) -> float:
    """A score in [0, 1] for a pair of texts: the same for the same pair."""
    digest = hashlib.blake2b(
        a.encode("utf-8", "surrogatepass") + b"\x00" + b.encode("utf-8", "surrogatepass"),
        digest_size=8,
    ).digest()
    return round(int.from_bytes(digest, "little") / 2**64, 6)


def _texts(value: Any, field: str) -> list[str]:
    """A string, a list of strings, token ids, or lists of token ids (as `tok{id}` words)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if _is_ids(value):
            return [_ids_text(value)]
        if all(isinstance(item, list) and _is_ids(item) for item in value):
            return [_ids_text(item) for item in value]
    raise BadGenerationRequest(
        f"'{field}' must be a string, a non-empty list of strings (at most {MAX_INPUTS}), token ids or token id lists"
    )


def _is_ids(value: list[Any]) -> bool:
    return bool(value) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in value
    )


def _ids_text(ids: list[int]) -> str:
    return " ".join(f"tok{token}" for token in ids)


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _words(texts: list[str]) -> int:
    return sum(count_words(text) for text in texts)


def embeddings(body: dict[str, Any], ctx: PoolingContext) -> dict[str, Any]:
    texts = _texts(body.get("input"), "input")
    dim = body.get("dimensions", ctx.embedding_dim)
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= ctx.embedding_dim:
        raise BadGenerationRequest(
            f"'dimensions' must be an integer between 1 and {ctx.embedding_dim}"
        )
    data = [
        {"object": "embedding", "index": i, "embedding": vector(text, dim)}
        for i, text in enumerate(texts)
    ]
    usage = _usage(_words(texts))
    del usage["completion_tokens"]
    return {"object": "list", "data": data, "model": ctx.model, "usage": usage}


def pooling(body: dict[str, Any], ctx: PoolingContext) -> dict[str, Any]:
    texts = _texts(body.get("input"), "input")
    data = [
        {"index": i, "object": "pooling", "data": vector(text, ctx.embedding_dim)}
        for i, text in enumerate(texts)
    ]
    return {
        "id": f"pool-{ctx.request_id}",
        "object": "list",
        "created": ctx.created,
        "model": ctx.model,
        "data": data,
        "usage": _usage(_words(texts)),
    }


def rerank(body: dict[str, Any], ctx: PoolingContext) -> Any:
    query = body.get("query")
    if not isinstance(query, str):
        raise BadGenerationRequest("'query' must be a string")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents or len(documents) > MAX_INPUTS:
        raise BadGenerationRequest("'documents' must be a non-empty list")
    texts: list[str] = []
    for doc in documents:
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise BadGenerationRequest("each document must be a string or an object with 'text'")
        texts.append(text)
    scored = sorted(
        ((similarity(query, text), i, text) for i, text in enumerate(texts)),
        key=lambda t: (-t[0], t[1]),
    )
    top_n = body.get("top_n")
    if isinstance(top_n, int) and not isinstance(top_n, bool) and top_n > 0:
        scored = scored[:top_n]
    tokens = count_words(query) * len(texts) + _words(texts)
    if ctx.engine == "sglang":
        # SGLang's /v1/rerank: a bare list, best first.
        return [
            {
                "score": score,
                "document": text if body.get("return_documents", True) else None,
                "index": i,
                "meta_info": {"prompt_tokens": count_words(query) + count_words(text)},
            }
            for score, i, text in scored
        ]
    results = [
        {"index": i, "document": {"text": text}, "relevance_score": score}
        for score, i, text in scored
    ]
    return {
        "id": f"rerank-{ctx.request_id}",
        "model": ctx.model,
        "usage": {"total_tokens": tokens},
        "results": results,
    }


def score(body: dict[str, Any], ctx: PoolingContext) -> dict[str, Any]:
    if ctx.engine == "sglang":
        # SGLang's /v1/score: one probability list per item, one entry per label token id.
        query = body.get("query")
        items = _texts(body.get("items"), "items")
        if not isinstance(query, str):
            raise BadGenerationRequest("'query' must be a string")
        labels = body.get("label_token_ids")
        if not isinstance(labels, list) or not labels or not _is_ids(labels):
            raise BadGenerationRequest("'label_token_ids' must be a non-empty list of token ids")
        scores = [[similarity(query + item, str(label)) for label in labels] for item in items]
        tokens = count_words(query) * len(items) + _words(items)
        return {"scores": scores, "model": ctx.model, "usage": _usage(tokens), "object": "scoring"}
    first = _texts(body.get("text_1"), "text_1")
    second = _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise BadGenerationRequest(
            "'text_1' and 'text_2' must have the same length, or 'text_1' one text"
        )
    data = [
        {"index": i, "object": "score", "score": similarity(a, b)}
        for i, (a, b) in enumerate(zip(first, second, strict=True))
    ]
    return {
        "id": f"score-{ctx.request_id}",
        "object": "list",
        "created": ctx.created,
        "model": ctx.model,
        "data": data,
        "usage": _usage(_words(first) + _words(second)),
    }


def classify(body: dict[str, Any], ctx: PoolingContext) -> dict[str, Any]:
    texts = _texts(body.get("input"), "input")
    data = []
    for i, text in enumerate(texts):
        positive = similarity(text, "positive")
        probs = [round(1 - positive, 6), positive]
        data.append(
            {
                "index": i,
                "label": "LABEL_1" if positive >= 0.5 else "LABEL_0",
                "probs": probs,
                "num_classes": 2,
            }
        )
    return {
        "id": f"classify-{ctx.request_id}",
        "object": "list",
        "created": ctx.created,
        "model": ctx.model,
        "data": data,
        "usage": _usage(_words(texts)),
    }


def tokenize(body: dict[str, Any], ctx: PoolingContext) -> dict[str, Any]:
    if ctx.model_tokens is not None:
        tokens = _model_token_ids(body, ctx.model_tokens)
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = " ".join(
            m["content"]
            for m in body["messages"]
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    if not isinstance(prompt, str):
        raise BadGenerationRequest("'prompt' must be a string (or 'messages' a list of messages)")
    tokens = word_ids(prompt)
    if ctx.engine == "vllm":
        # `token_strs` is null unless the request sets `return_token_strs`.
        strs = [f"tok{token}" for token in tokens] if body.get("return_token_strs") else None
        return {
            "count": len(tokens),
            "max_model_len": ctx.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
    return {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN}


def _model_token_ids(body: dict[str, Any], model: ModelTokens) -> list[int]:
    """The model's ids for a tokenize body: its messages rendered as a chat request is,
    or its prompt encoded as a completions prompt is."""
    from router.prompts.chat_request import NotRendered
    from router.prompts.chat_template import TemplateFailed

    tokenizer = model.tokenizer
    try:
        if isinstance(body.get("messages"), list):
            return tokenizer.chat_tokens(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, body.get("add_special_tokens", True) is not False)
    except (NotRendered, TemplateFailed) as exc:
        raise BadGenerationRequest(f"cannot tokenize this request: {exc}") from None
    raise BadGenerationRequest("'prompt' must be a string (or 'messages' a list of messages)")


def detokenize(body: dict[str, Any], ctx: PoolingContext) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise BadGenerationRequest("'tokens' must be a list of token ids")
    text = "".join(f"tok{token} " for token in tokens)
    return {"text": text} if ctx.engine == "sglang" else {"prompt": text}


POOLING_ROUTES: dict[str, Callable[[dict[str, Any], PoolingContext], Any]] = {
    "/v1/embeddings": embeddings,
    "/v1/rerank": rerank,
    "/v1/score": score,
    "/v1/classify": classify,
    "/v1/tokenize": tokenize,
    "/v1/detokenize": detokenize,
    "/tokenize": tokenize,
    "/detokenize": detokenize,
    "/pooling": pooling,
}

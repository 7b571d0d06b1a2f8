"""The fake's token ids: the vocabulary its answers are made of, the ids of a prompt, and
the rule that picks the next token, deterministic, so a generation continued elsewhere is
exact.

- Generated token `k` has id `k` and reads `tok{k} `, as `/detokenize` answers.
- A prompt's ids are the prompt itself when it comes as ids (a completions prompt of ids,
  a chat request's `kv_transfer_params.prompt_token_ids`, as vLLM takes them), else one id
  per whitespace-separated word, derived from its bytes (`word_ids`), as `/tokenize`
  answers.
- The next token (the fake's greedy decoding): a prompt of ids that ends with the ids
  `0, 1, ..., j` goes on with `j + 1`; any other prompt begins with `0`. So a fresh
  request generates `tok0 tok1 ...`, and a prompt made of it and its first `k` generated
  ids goes on with `tok{k}`: the continuation of `prompt + generated` is exactly what the
  unbroken run would have generated, as greedy decoding on a real engine gives.
- `write_tokenizer` writes the vocabulary as a `tokenizer.json` that decodes id `k` to
  `tok{k} `: a router given it (`--kv-tokenizer`) detokenizes the fake's ids as it would
  a real model's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VOCABULARY = 50_000
"""Ids the fake knows: words of a prompt hash into them, and generated token `k` < this
has a text in `write_tokenizer`'s file."""


def word_ids(text: str) -> list[int]:
    """The fake tokenizer: one id per whitespace-separated word, from its bytes."""
    return [
        int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little")
        % VOCABULARY
        for word in text.split()
    ]


def is_token_ids(value: Any) -> bool:
    """A non-empty list of non-negative integers (what vLLM accepts as a prompt of ids)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def first_token(prompt_ids: Sequence[int]) -> int:
    """The id the fake generates first after `prompt_ids`: `j + 1` when they end with
    `0, 1, ..., j`, else `0`. Costs a scan of the run at the prompt's end."""
    if not prompt_ids:
        return 0
    last = prompt_ids[-1]
    if last < 0 or last >= len(prompt_ids):
        return 0
    start = len(prompt_ids) - 1 - last
    for offset in range(last + 1):
        if prompt_ids[start + offset] != offset:
            return 0
    return last + 1


def write_tokenizer(path: Path) -> Path:
    """Write the vocabulary (`tok{k} ` for every id below `VOCABULARY`) as a tokenizer.json
    at `path` (a file, or a directory to hold `tokenizer.json`); returns the file written.
    Needs the `tokenizers` package (the `kv` extra)."""
    from tokenizers import Tokenizer, decoders, models

    file = path / "tokenizer.json" if path.is_dir() else path
    vocabulary = {f"tok{k} ": k for k in range(VOCABULARY)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="tok0 "))
    # The texts already carry their space: decoding joins them as they are.
    tokenizer.decoder = decoders.Fuse()
    file.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(file))
    return file

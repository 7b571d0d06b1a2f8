"""The fake gRPC engine's model directory: a tokenizer a router can load, written from code.

A router in front of a gRPC engine renders and tokenizes prompts itself, and turns the
token ids the engine streams back into text. It finds the tokenizer in the directory
`GetModelInfo.tokenizer_path` names (or asks `GetTokenizer` for those files), so the
fake must name a real one: `tokenizer.json` and a `tokenizer_config.json` whose
`chat_template` renders chat requests.

The tokenizer is a word-level one, written as JSON (nothing trained, nothing binary,
nothing to ship): its vocabulary is a few special tokens, `[UNK]` and the fake's own
output words `tok0 ... tok{N-1}`, split on whitespace and punctuation. A prompt's words
are mostly unknown, so a prompt costs one token per word or mark, which is all the fake
needs of it. Generated token `k` is the word `tok{k mod N}`, and a tokenizer without a
decoder joins words with one space, so a router decodes the fake's output to the text
the HTTP fake writes (`tok0 tok1 ...`) for the first N tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOS, PAD, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "[UNK]"
SPECIAL_TOKENS = (BOS, EOS, PAD)
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 0, 1, 2, 3
FIRST_WORD_ID = 4
# Output words in the vocabulary; generated token k is word k mod OUTPUT_WORDS.
OUTPUT_WORDS = 1000
VOCAB_SIZE = FIRST_WORD_ID + OUTPUT_WORDS
MAX_MODEL_LEN = 2048

# A role line per message, text parts joined (OpenAI's list form of `content` too), and
# an opened assistant turn for the answer. Plain words and spaces, so a prompt tokenizes
# to about one token per word.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def output_token_id(k: int) -> int:
    """The id of the fake's `k`-th generated token (0-based): the word `tok{k mod N}`."""
    return FIRST_WORD_ID + k % OUTPUT_WORDS


def word_id(word: str) -> int:
    """The id of one pre-tokenized word (no whitespace in it): `tok{k}` for `k` below
    `OUTPUT_WORDS` is its own word, anything else `[UNK]`, as `tokenizer.json` reads it."""
    digits = word.removeprefix("tok")
    if digits != word and digits.isascii() and digits.isdigit():
        k = int(digits)
        if k < OUTPUT_WORDS and str(k) == digits:
            return FIRST_WORD_ID + k
    return UNK_ID


def tokenizer_json() -> dict[str, Any]:
    """`tokenizer.json` in the format of Hugging Face `tokenizers`: a word-level model."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab[UNK] = UNK_ID
    for k in range(OUTPUT_WORDS):
        vocab[f"tok{k}"] = FIRST_WORD_ID + k
    added = [
        {
            "id": index,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }


def tokenizer_config(model_max_length: int = MAX_MODEL_LEN) -> dict[str, Any]:
    """`tokenizer_config.json`: the special tokens by name, and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def config_json(model_max_length: int = MAX_MODEL_LEN) -> dict[str, Any]:
    """`config.json`: what a router reads of the model beside its tokenizer."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": model_max_length,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def write_model_dir(directory: Path, model_max_length: int = MAX_MODEL_LEN) -> Path:
    """Write the tokenizer files into `directory` (made if missing; files of the same
    names are replaced) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    contents = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tokenizer_config(model_max_length),
        "config.json": config_json(model_max_length),
    }
    for name in FILES:
        (directory / name).write_text(json.dumps(contents[name], indent=1) + "\n", encoding="utf-8")
    return directory

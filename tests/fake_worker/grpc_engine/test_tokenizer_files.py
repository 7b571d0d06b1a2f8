"""The fake gRPC engine's tokenizer, read the way a router reads one: Hugging Face
`tokenizers` for `tokenizer.json`, jinja2 for the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

from router.fake_worker.grpc_engine.tokenizer_files import (
    EOS_ID,
    OUTPUT_WORDS,
    UNK_ID,
    VOCAB_SIZE,
    output_token_id,
    word_id,
    write_model_dir,
)


def test_the_output_ids_decode_to_the_http_fakes_text(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(write_model_dir(tmp_path) / "tokenizer.json"))
    ids = [output_token_id(k) for k in range(5)]
    assert tokenizer.decode(ids) == "tok0 tok1 tok2 tok3 tok4"
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert output_token_id(OUTPUT_WORDS) == output_token_id(0)
    assert tokenizer.decode([output_token_id(0), EOS_ID]) == "tok0"  # special: skipped


def test_a_prompt_is_a_token_per_word_or_mark(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(write_model_dir(tmp_path) / "tokenizer.json"))
    encoded = tokenizer.encode("user: hello world, tok7")
    assert encoded.ids == [UNK_ID, UNK_ID, UNK_ID, UNK_ID, UNK_ID, output_token_id(7)]


def test_the_chat_template_renders_string_and_list_content(tmp_path: Path) -> None:
    config = json.loads((write_model_dir(tmp_path) / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(config["chat_template"])
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
    ]
    text = template.render(
        messages=messages, add_generation_prompt=True, bos_token=config["bos_token"]
    )
    assert text == "<|begin_of_text|>system: be brief\nuser: hi\nassistant: "


def test_writing_twice_replaces_the_files(tmp_path: Path) -> None:
    write_model_dir(tmp_path, model_max_length=100)
    write_model_dir(tmp_path, model_max_length=300)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 300


def test_a_words_id_is_what_the_tokenizer_reads(tmp_path: Path) -> None:
    # The ids the prefix cache keeps for a text prompt are the ids a router would send.
    tokenizer = Tokenizer.from_file(str(write_model_dir(tmp_path) / "tokenizer.json"))
    text = "hello, world tok1 tok01 tok999 tok1000 x_tok3 tok3b ..!"
    words = [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert [word_id(word) for word in words] == tokenizer.encode(text).ids
    assert tokenizer.encode(text).ids == [3, 3, 3, 5, 3, 1003, 3, 3, 3, 3]

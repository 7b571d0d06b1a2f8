"""The router's own detokenizer makes the text of generated ids as vLLM streams it: a
character split over ids waits for its last byte, stop strings end the text (across ids,
after `min_tokens`), the characters that could begin one are held back until the end,
and a client's text is accepted at a seam only when the ids account for it."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.fake_worker.vocabulary import write_tokenizer
from router.prompts.detokenize import StreamedText, find_stop
from router.prompts.tokenizer import HfTokenizer

CORPUS = ["hello world café 東京 naïve 🙂 end of the line"] * 50


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    """A byte-level BPE (as GPT-style models have): a multi-byte character may take
    several ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return HfTokenizer(str(path))


@pytest.fixture(scope="module")
def fake_vocabulary(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(str(write_tokenizer(tmp_path_factory.mktemp("fake") / "tokenizer.json")))


def text_of(tokenizer: HfTokenizer, ids: list[int], **kwargs: object) -> tuple[list[str], str]:
    """Each id's delta and the whole text, as `StreamedText` gives them out."""
    text = StreamedText(tokenizer.decode_stream([]), **kwargs)  # type: ignore[arg-type]
    deltas = []
    for token in ids:
        text.push(token)
        deltas.append(text.take())
        if text.stopped_by is not None:
            break
    deltas.append(text.take(finished=True))
    return deltas, "".join(deltas)


def test_a_character_split_over_ids_comes_out_whole_with_its_last_id(
    byte_level: HfTokenizer,
) -> None:
    ids = byte_level.encode(" 東京🙂 café", add_special_tokens=False)
    deltas, whole = text_of(byte_level, ids)
    assert whole == " 東京🙂 café"
    # Some id gave no text (a partial character) and none gave half a character.
    assert "" in deltas[:-1]
    assert all("\ufffd" not in delta for delta in deltas)


def test_priming_with_the_prompt_changes_nothing_for_a_clean_boundary(
    byte_level: HfTokenizer,
) -> None:
    prompt = byte_level.encode("hello world", add_special_tokens=False)
    ids = byte_level.encode(" naïve end", add_special_tokens=False)
    primed = StreamedText(byte_level.decode_stream(prompt))
    for token in ids:
        primed.push(token)
    assert primed.take(finished=True) == " naïve end"


def test_a_stop_string_across_ids_ends_the_text_before_it(fake_vocabulary: HfTokenizer) -> None:
    deltas, whole = text_of(fake_vocabulary, list(range(10)), stops=["2 tok3"])
    assert whole == "tok0 tok1 tok"
    # Held back: 5 characters (len - 1) until the end.
    assert deltas[:3] == ["", "tok0 ", "tok1 "]


def test_the_stop_string_is_kept_when_asked_and_ids_after_it_do_not_count(
    fake_vocabulary: HfTokenizer,
) -> None:
    text = StreamedText(fake_vocabulary.decode_stream([]), stops=["tok2"], include_stop=True)
    for token in range(3):
        text.push(token)
    assert (text.stopped_by, text.tokens) == ("tok2", 3)
    assert text.take() == "tok0 tok1 tok2"
    with pytest.raises(ValueError):
        text.push(3)


def test_no_stop_string_is_looked_for_before_min_tokens(fake_vocabulary: HfTokenizer) -> None:
    _, early = text_of(fake_vocabulary, list(range(6)), stops=["tok1"])
    _, late = text_of(fake_vocabulary, list(range(6)), stops=["tok1"], min_tokens=3)
    assert early == "tok0 "
    assert late == "tok0 tok1 tok2 tok3 tok4 tok5 "


def test_the_stop_token_is_counted_but_not_shown(fake_vocabulary: HfTokenizer) -> None:
    text = StreamedText(fake_vocabulary.decode_stream([]))
    text.push(0)
    text.push_stop_token(1)
    assert (text.tokens, text.take(finished=True)) == (2, "tok0 ")


def test_a_seam_accepts_the_held_back_text_and_refuses_any_other(
    fake_vocabulary: HfTokenizer,
) -> None:
    def after_three(received: str) -> bool:
        text = StreamedText(fake_vocabulary.decode_stream([]), stops=["never"])
        for token in range(3):
            text.push(token)
        return text.seam(received)

    # "never" holds 4 characters back: the engine had sent all but "tok2"'s last four.
    assert after_three("tok0 tok1 t")
    assert not after_three("tok0 tok1 tok2 ")  # more than the ids allow while held back
    assert not after_three("tok0 tok1 ")  # less
    assert not after_three("tok0 tokX t")


def test_after_a_seam_the_text_goes_on_from_where_the_client_is(
    fake_vocabulary: HfTokenizer,
) -> None:
    text = StreamedText(fake_vocabulary.decode_stream([]), stops=["tok3 tok4"])
    for token in range(3):
        text.push(token)
    # 8 characters are held back (the stop string's length - 1): "k1 tok2 ".
    assert text.seam("tok0 to")
    for token in range(3, 6):
        text.push(token)
        if text.stopped_by:
            break
    assert (text.stopped_by, text.tokens, text.take()) == ("tok3 tok4", 5, "k1 tok2 ")


def test_the_earliest_completed_stop_string_wins() -> None:
    assert find_stop("abcdef", 3, ["def", "cd"]) == ("cd", 2)
    assert find_stop("abcdef", 1, ["cd"]) is None
    assert find_stop("abcdef", 0, ["def"]) is None


def test_a_tokens_own_text_is_the_id_decoded_alone_as_vllm_writes_logprobs(
    byte_level: HfTokenizer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Byte-level: the id decoded alone, special tokens kept; half a character is U+FFFD.
    hello = byte_level.encode("hello")
    assert "".join(byte_level.token_text(i) for i in hello) == "hello"
    assert byte_level.token_text(byte_level.encode("<s>")[0]) == "<s>"
    assert byte_level.token_text(10**7) == ""
    # SentencePiece-style (Metaspace): decoding strips the leading space; it is put back.
    metaspace = Tokenizer(models.WordLevel({"▁hello": 0, "world": 1, "[UNK]": 2}, "[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    path = tmp_path_factory.mktemp("metaspace") / "tokenizer.json"
    metaspace.save(str(path))
    spm = HfTokenizer(str(path))
    assert metaspace.decode([0]) == "hello"
    assert (spm.token_text(0), spm.token_text(1)) == (" hello", "world")


def test_a_token_inside_a_character_is_completed_from_the_ids_sampled_before_it(
    byte_level: HfTokenizer,
) -> None:
    # As vLLM's logprobs processor writes it: the id that finishes a character carries the
    # whole character (and only that), the ids before it inside the character carry "".
    *start, last = byte_level.encode("🚀")  # not in the corpus: its bytes in 3 or 4 ids
    hello = byte_level.encode("hello")
    assert len(start) >= 2
    assert [byte_level.token_text(i) for i in start] == [""] * len(start)
    assert byte_level.token_text(last, context=start) == "🚀"
    assert byte_level.token_text(last, context=[*hello, *start]) == "🚀"
    # A context that does not reach the character's first byte leaves it unfinished.
    assert byte_level.token_text(last, context=start[1:]) == ""
    # An id that is a whole character is itself, whatever came before.
    assert byte_level.token_text(hello[0], context=start) == byte_level.token_text(hello[0])

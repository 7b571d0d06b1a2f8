"""Write a tiny random-weight Llama that a real vLLM engine can serve, from nothing but code.

Run with the engine venv's Python (it needs `tokenizers`, `transformers` and `torch`,
which `.venv` does not have):

    .venv-engine/bin/python conformance/tiny_model.py build/tiny-model

What it writes, with nothing from any model hub:
- a byte-level BPE tokenizer trained with `tokenizers` on a corpus this script makes
  (deterministic: the same words in the same order every run), with a chat template in
  `tokenizer_config.json` that vLLM's chat endpoint renders;
- a 2-layer Llama (hidden 128, head size 32, vocab `VOCAB_SIZE`, 2,048 positions) whose weights come
  from a fixed seed, saved with `transformers` as safetensors.

The text it generates is noise; what the tests need is an engine that tokenizes, batches,
schedules, caches prefixes and streams like any other. A complete OUT_DIR (a marker file
written last) is left as it is, so `make engine-env` is cheap the second time.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 24
VOCAB_SIZE = 1024
MAX_POSITIONS = 2048
MARKER = ".tiny-model-complete"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
BOS, EOS, PAD = SPECIAL_TOKENS

# Roles and text joined the way Llama-style templates do; `add_generation_prompt` opens
# the assistant turn so the model's answer follows it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORDS = (
    "the a an router worker engine request stream token cache prefix block model fleet "
    "prefill decode drain breaker health metric latency answer question system user "
    "assistant hello world please tell me about how why what when where which who "
    "is are was were be been being have has had do does did will would can could "
    "one two three four five six seven eight nine ten hundred thousand "
    "red green blue quick brown fox jumps over lazy dog river mountain city road "
    "and or but if then else for while with without from into onto of in on at by"
).split()


def corpus(lines: int = 4000) -> list[str]:
    """Sentences of the words above, with digits and punctuation, from a fixed seed."""
    rng = random.Random(SEED)
    out = []
    for index in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if index % 5 == 0:
            words.append(str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,;:"))
    return out


def complete(out_dir: Path) -> bool:
    return (out_dir / MARKER).is_file()


def write_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # Older transformers keep the template in a file of its own; vLLM reads it from
    # tokenizer_config.json, so it goes there in every case.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def write_model(out_dir: Path, vocab_size: int) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # The CPU attention backend takes head sizes 32, 64, 80, ... only.
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=ids.token_to_id(BOS),
        eos_token_id=ids.token_to_id(EOS),
        pad_token_id=ids.token_to_id(PAD),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def write_tiny_model(out_dir: Path) -> bool:
    """Write the model into `out_dir`; False when it was already complete (nothing done)."""
    if complete(out_dir):
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir)
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size()
    write_model(out_dir, vocab_size)
    (out_dir / MARKER).write_text(f"seed {SEED}, vocab {vocab_size}\n")
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    wrote = write_tiny_model(out_dir)
    print(f"{'wrote' if wrote else 'already complete:'} {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

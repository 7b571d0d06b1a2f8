"""Write tiny random-weight LoRA adapters for the tiny model, from nothing but code.

Run with the engine venv's Python (it needs `torch` and `safetensors`, which `.venv` does
not have):

    .venv-engine/bin/python conformance/lora_adapters.py build/tiny-model build/lora a b c

What it writes, one directory per name under OUT_DIR: a PEFT `adapter_config.json`
(rank 8, on every layer's `q_proj` and `v_proj`) and `adapter_model.safetensors` with
weights from a seed of the name's own, so the same name gives the same adapter every
run. vLLM serves them with `--enable-lora --max-lora-rank 8 --lora-modules NAME=DIR`; what
they generate is noise, as the model's own text is. A complete adapter directory (its
marker written last) is left as it is.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
MARKER = ".lora-adapter-complete"


def adapter_config(model_dir: Path) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_adapter(model_dir: Path, out_dir: Path, name: str) -> Path:
    """One adapter named `name` for the model in `model_dir`, in `out_dir/name`."""
    # The engine venv's, imported where needed: .venv (which mypy reads) has neither.
    import torch
    from safetensors.torch import save_file

    target = out_dir / name
    if (target / MARKER).exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(RANK, hidden, generator=generator) * 0.05
            ).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(outputs[module], RANK, generator=generator) * 0.05
            ).contiguous()
    save_file(tensors, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps(adapter_config(model_dir), indent=2))
    (target / MARKER).write_text("")
    return target


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: lora_adapters.py MODEL_DIR OUT_DIR NAME [NAME ...]", file=sys.stderr)
        return 2
    model_dir, out_dir = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    for name in argv[2:]:
        print(write_adapter(model_dir, out_dir, name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Preference data in the public layouts, learnable on purpose: the chosen answer is a sum, the rejected a wrong one."""

from __future__ import annotations

import random
import shutil
from pathlib import Path


def pair_records(count: int, seed: int = 0) -> list[dict]:
    """prompt/chosen/rejected strings: chosen ' {a+b} ok', rejected ' {a*b+1} bad' (easy to prefer)."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        records.append(
            {"prompt": f"Q{i}: {a}+{b}=", "chosen": f" {a + b} ok", "rejected": f" {a * b + 1} bad"}
        )
    return records


def kto_records(count: int, seed: int = 0) -> list[dict]:
    """prompt/completion/label: every other example desirable."""
    return [
        {
            "prompt": r["prompt"],
            "completion": r["chosen"] if i % 2 == 0 else r["rejected"],
            "label": i % 2 == 0,
        }
        for i, r in enumerate(pair_records(count, seed))
    ]


def wide_llama(out: Path, tokenizer: Path, seed: int = 1234) -> Path:
    """A 256-wide tiny Llama (torchao's NF4 shards whole 16384-weight groups under FSDP2) with the tests' tokenizer."""
    import torch
    from hf_assets import hf_config
    from transformers import AutoModelForCausalLM

    config = hf_config("llama", vocab_size=400)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for path in tokenizer.iterdir():
        shutil.copy(path, out / path.name)
    return out


if __name__ == "__main__":  # `python tests/preference_assets.py preference|kto [COUNT]`: JSONL on stdout
    import json
    import sys

    make = kto_records if sys.argv[1:2] == ["kto"] else pair_records
    for item in make(int(sys.argv[2]) if len(sys.argv) > 2 else 200):
        print(json.dumps(item))

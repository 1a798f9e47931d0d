"""Test assets built locally, nothing downloaded: a byte-level BPE tokenizer and data files in public layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tokenizer(folder: Path, *, vocab_size: int = 400, chat_template: bool = True) -> Path:
    """Train a byte-level BPE on part of the standard library and save it in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from launcher.components.data.sources import stdlib_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(path) for _, path in stdlib_files()[:30]], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(str(folder))
    if chat_template:  # kept inside tokenizer_config.json, the layout most published tokenizers use
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = CHAT_TEMPLATE
        config_path.write_text(json.dumps(config, indent=1))
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def with_chat_template(source: Path, folder: Path, template: str) -> Path:
    """A copy of the tokenizer folder `source` at `folder` whose tokenizer_config.json holds `template`."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def alpaca_records(count: int) -> list[dict]:
    """Records in the alpaca layout, every third without an input."""
    return [
        {
            "instruction": f"Write the number {i} in words and say why it matters {i % 7}.",
            "input": "" if i % 3 == 0 else f"context number {i}",
            "output": f"The number is {i}; it matters because {i} follows {i - 1}.",
        }
        for i in range(count)
    ]


def chat_records(count: int) -> list[dict]:
    """Records in the `messages` layout: system, user, assistant turns (some with two exchanges)."""
    records = []
    for i in range(count):
        messages = [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": "And times two?"},
                {"role": "assistant", "content": f"That is {4 * i}."},
            ]
        records.append({"messages": messages})
    return records


def sharegpt_records(count: int) -> list[dict]:
    """chat_records(count) in ShareGPT's layout: a `system` string, then human/gpt `conversations` turns."""
    roles = {"user": "human", "assistant": "gpt"}
    return [
        {
            "system": record["messages"][0]["content"],
            "conversations": [
                {"from": roles[m["role"]], "value": m["content"]} for m in record["messages"][1:]
            ],
        }
        for record in chat_records(count)
    ]


def text_records(count: int) -> list[dict]:
    """Plain documents of different lengths."""
    return [{"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 9)} for i in range(count)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_json(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def make_sentencepiece_tokenizer(folder: Path, *, vocab_size: int = 512, config: bool = True) -> Path:
    """Train a SentencePiece BPE as Llama's tokenizer.model is made (byte fallback, no whitespace folding).

    With `config`, a tokenizer_config.json as published Llama/Mistral folders hold it; without, the
    bare `tokenizer.model` of llama2.c-style folders. About 0.5 s on part of the standard library.
    """
    import io

    import sentencepiece

    from launcher.components.data.sources import stdlib_files

    lines = [
        line for _, path in stdlib_files()[:20] for line in path.read_text().splitlines() if line.strip()
    ]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    if config:
        settings = {
            "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": CHAT_TEMPLATE,
        }  # fmt: skip
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    return folder


def make_gpt2_vocab_files(folder: Path) -> Path:
    """GPT-2's slow-tokenizer files alone (vocab.json with <|endoftext|>, merges.txt), from `make_tokenizer`'s BPE."""
    trained = make_tokenizer(folder / ".trained", chat_template=False)
    model = json.loads((trained / "tokenizer.json").read_text())["model"]
    vocab = {token: i for token, i in model["vocab"].items()}
    vocab["<|endoftext|>"] = len(vocab)
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model["merges"]]
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    for file in trained.iterdir():
        file.unlink()
    trained.rmdir()
    return folder

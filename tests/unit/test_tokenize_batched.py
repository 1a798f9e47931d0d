"""Batched tokenization: exactly the tokens and flags of encoding one record at a time, in every format and
with both tokenizers; the same cache bytes for every data.num_proc; the caches recorded before batching."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from data_assets import alpaca_records, chat_records, sharegpt_records, text_records, write_jsonl

from launcher.components.data.formats import encode_record, encode_records
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import build_cache
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig

UNICODE = ["", "héllo wörld ✓ 😀 naïve", "日本語のテキスト", " a", "x" * 3000]
RECORDS = {
    "text": text_records(150) + [{"text": t} for t in UNICODE] + text_records(40),
    "chat": chat_records(130)
    + [{"messages": [{"role": "user", "content": "ünï ✓"}, {"role": "assistant", "content": "😀 é"}]}],
    "instruction": alpaca_records(120),
    "sharegpt": sharegpt_records(20),
    "pretokenized": [
        {"input_ids": [5, 6, 7, 8]},
        {"input_ids": [9, 1], "labels": [-100, 1]},
        {"input_ids": []},
    ],
}
BYTES_DIGESTS = {  # sha256 of train/val tokens and flags, written by the one-record-at-a-time path it replaced
    "text": "5560488d95762484d7f618d9a49ccd9ae3b36f3452aeabb4f8c6af9c1e3a6719",
    "chat": "0fff4bb40c473adf3f4f83c821dd5d9a3b3447f7bf5fdf8c7529ba3dd288f366",
    "instruction": "a47d97f3196582086ce421d6e3f0378a6a9bcc26d90d5281fdd70737a19cb3f8",
}


def _tok_cfg(kind: str, hf_tokenizer) -> TokenizerConfig:
    return (
        TokenizerConfig(kind="hf", path=str(hf_tokenizer)) if kind == "hf" else TokenizerConfig(kind="bytes")
    )


@pytest.mark.parametrize("kind", ["hf", "bytes"])
@pytest.mark.parametrize(
    ("fmt", "train_on"),
    [(fmt, "completion") for fmt in RECORDS] + [("chat", "all"), ("instruction", "all")],
)
def test_a_batch_encodes_as_each_record_alone(fmt, train_on, kind, hf_tokenizer) -> None:
    tok_cfg = _tok_cfg(kind, hf_tokenizer)
    if kind == "hf":  # bos and eos around text and instruction documents
        tok_cfg = TokenizerConfig(kind="hf", path=str(hf_tokenizer), add_bos=True)
    tokenizer = load_tokenizer(tok_cfg)
    cfg = DataConfig(kind="jsonl", format=fmt, train_on=train_on)
    items = [(f"r{i}", record) for i, record in enumerate(RECORDS[fmt])]
    # the first batch decides whether later ones may take their ids straight from the Rust tokenizer
    encode_records(items, cfg, tok_cfg, tokenizer)
    batched = encode_records(items, cfg, tok_cfg, tokenizer)
    assert len(batched) == len(items)
    if kind == "hf" and fmt == "text":
        assert tokenizer._direct  # the test tokenizer is a plain fast tokenizer: ids straight from Rust
    for (where, record), (ids, trained) in zip(items, batched, strict=True):
        alone_ids, alone_trained = encode_record(record, cfg, tok_cfg, tokenizer, where)
        assert ids.tolist() == alone_ids, where
        assert trained.tolist() == alone_trained, where
    if fmt in ("chat", "instruction") and train_on == "completion":
        assert any(not all(flags) and any(flags) for _, flags in batched)  # prompts are masked


def _digest(folder) -> str:
    digest = hashlib.sha256()
    for name in ("train.tokens", "train.flags", "val.tokens", "val.flags"):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def _cache(tmp_path, fmt: str, tok_cfg: TokenizerConfig, num_proc: int):
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", RECORDS[fmt])
    cfg = DataConfig(kind="jsonl", path=str(path), format=fmt, seq_len=64, num_proc=num_proc,
                     cache_dir=str(tmp_path / f"cache{num_proc}"))  # fmt: skip
    folder, built = build_cache(cfg, tok_cfg)
    assert built
    return folder


def test_every_num_proc_writes_the_same_cache_and_forks_no_tokenizer_threads(
    tmp_path, hf_tokenizer, capfd
) -> None:
    tok_cfg = _tok_cfg("hf", hf_tokenizer)
    load_tokenizer(tok_cfg).encode_batch([[("warm the tokenizer's threads up", True)]] * 4)
    one = _cache(tmp_path, "chat", tok_cfg, 1)
    two = _cache(tmp_path, "chat", tok_cfg, 2)
    for name in ("train.tokens", "train.flags", "val.tokens", "val.flags", "meta.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert "forked" not in capfd.readouterr().err  # tokenizers warns when its used threads are forked


@pytest.mark.parametrize("fmt", list(BYTES_DIGESTS))
def test_the_bytes_cache_is_the_one_written_before_batching(tmp_path, fmt) -> None:
    folder = _cache(tmp_path, fmt, TokenizerConfig(kind="bytes"), 1)
    assert _digest(folder) == BYTES_DIGESTS[fmt]
    shutil.rmtree(folder)

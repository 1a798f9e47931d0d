"""Data files and folders as people have them: a `datasets` save_to_disk folder (Dataset or DatasetDict), gzip'd
JSON Lines, sharded folders; a folder of mixed kinds is refused naming them; the token cache key follows them."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import datasets
import pytest
import torch

from conftest import TINY
from launcher.components.data.tokens import START, TokenStore, cache_key, load_corpus
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.front.cli import precheck

datasets.disable_progress_bars()
RECORDS = [{"text": f"record {i:03d} " * 6} for i in range(120)]  # 100+: held out by hash, whole documents


def _documents(store: TokenStore) -> list[bytes]:
    """The documents of a byte-token store, each without its closing 0 byte (eos)."""
    starts = torch.nonzero(store.flags & START).flatten().tolist() + [len(store)]
    data = bytes(store.tokens.tolist())
    return [data[a:b].removesuffix(b"\0") for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _texts(cfg: DataConfig) -> set[bytes]:
    corpus = load_corpus(cfg)
    return set(_documents(corpus.train) + _documents(corpus.val))


def _wanted(records: list[dict]) -> set[bytes]:
    return {r["text"].encode() for r in records}


def _precheck(path: Path | str, *extra: str) -> list[tuple[str, ...]]:
    return [e.keys for e in precheck(["data=files", f"data.path={path}", "data.format=auto", *TINY, *extra])]


def test_a_save_to_disk_dataset_is_read_with_load_from_disk_not_taken_for_a_registry(tmp_path) -> None:
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(folder), num_shards=2)
    assert (folder / "dataset_info.json").is_file()  # the name LLaMA-Factory's registry has too
    assert _precheck(folder) == []
    assert _texts(DataConfig(kind="files", path=str(folder), seq_len=16)) == _wanted(RECORDS)
    assert _precheck(folder, "data.kind=jsonl") == [("data.path", "data.kind")]


def test_a_dataset_dict_trains_on_its_train_split_and_names_the_splits_when_unclear(tmp_path) -> None:
    train, test = datasets.Dataset.from_list(RECORDS[:80]), datasets.Dataset.from_list(RECORDS[80:])
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    assert _precheck(folder, f"data.val_path={folder / 'test'}") == []
    cfg = DataConfig(kind="files", path=str(folder), val_path=str(folder / "test"), seq_len=16)
    corpus = load_corpus(cfg)
    assert set(_documents(corpus.train)) == _wanted(RECORDS[:80])
    assert set(_documents(corpus.val)) == _wanted(RECORDS[80:])
    unclear = tmp_path / "unclear"
    datasets.DatasetDict({"validation": train, "test": test}).save_to_disk(str(unclear))
    errors = precheck(["data=files", f"data.path={unclear}", *TINY])
    assert [e.keys for e in errors] == [("data.path",)]
    assert (
        "validation, test" in errors[0].message and f"data.path={unclear / 'validation'}" in errors[0].message
    )
    assert _precheck(unclear / "validation") == []  # the split's own folder chooses it


@pytest.mark.parametrize("kind", ["files", "jsonl"])
def test_gzipped_json_lines_and_arrays_are_read(tmp_path, kind: str) -> None:
    with gzip.open(tmp_path / "part-0.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS[:60])
    with gzip.open(tmp_path / "part-1.json.gz", "wt") as f:
        json.dump(RECORDS[60:], f)
    assert _precheck(tmp_path, f"data.kind={kind}") == []
    assert _texts(DataConfig(kind=kind, path=str(tmp_path), seq_len=16)) == _wanted(RECORDS)


def test_parquet_shards_of_a_folder_are_one_dataset_and_mixed_kinds_are_refused(tmp_path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(4):
        datasets.Dataset.from_list(RECORDS[i * 30 : (i + 1) * 30]).to_parquet(
            shards / f"data-{i:05d}-of-00004.parquet"
        )
    assert _precheck(shards) == []
    assert _texts(DataConfig(kind="files", path=str(shards), seq_len=16)) == _wanted(RECORDS)
    (shards / "extra.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    errors = precheck(["data=files", f"data.path={shards}", *TINY])
    assert [e.keys for e in errors] == [("data.path",)]
    assert ".jsonl (1 file), .parquet (4 files)" in errors[0].message


def test_the_cache_key_follows_saved_and_gzipped_files(tmp_path) -> None:
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(folder))
    gz = tmp_path / "records.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS)
    tok = TokenizerConfig()
    keys = {}
    for path in (folder, gz):
        cfg = DataConfig(kind="files", path=str(path), seq_len=16)
        before = cache_key(cfg, tok)
        arrow = next(folder.glob("*.arrow")) if path == folder else gz
        stat = arrow.stat()
        os.utime(arrow, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten: a new mtime
        keys[path] = (before, cache_key(cfg, tok))
    assert all(before != after for before, after in keys.values())

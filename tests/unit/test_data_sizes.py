"""Data sizes before launch: the counts equal the ranks' datasets, too little data is refused with its numbers
(exit status 2, no run directory), and a one-file corpus keeps its training side and trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from data_assets import alpaca_records, write_jsonl

from conftest import TINY
from launcher.components.data.batching import Documents
from launcher.components.data.sequences import PackedSequences
from launcher.components.data.sizes import document_sequences, packed_sequences
from launcher.components.data.split import is_val_document
from launcher.components.data.tokens import load_corpus
from launcher.config.data import DataConfig
from launcher.front import cli, compose
from launcher.front.data_sizes import size_errors
from launcher.front.tokenize import prepare_data

TWO_RANKS = ["launcher=local", "launcher.nproc=2", "parallel=ddp"]


def _spec(*overrides: str):
    spec, errors = compose.validate(compose.compose(list(overrides)))
    assert errors == []
    return spec


def _book(folder: Path, lines: int = 400) -> Path:
    """One text file whose name the document hash holds out (the whole book would be held out by hash)."""
    assert is_val_document("book321.txt", 0.02) and is_val_document("book321.txt:0", 0.02)
    path = folder / "book321.txt"
    path.write_text("".join(f"line {i}: and so the king spoke to the court\n" for i in range(lines)))
    return path


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_counts_equal_the_ranks_datasets(tmp_path, seq_len: int) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * (i % 50)} for i in range(150)])  # empty and short ones
    corpus = load_corpus(
        DataConfig(kind="jsonl", path=str(tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "c"))
    )
    for store in (corpus.train, corpus.val):
        assert packed_sequences(len(store), seq_len) == len(PackedSequences(store, seq_len))
        assert document_sequences(store.flags.numpy(), seq_len) == len(Documents(store, seq_len))
    assert packed_sequences(0, 8) == 0 and packed_sequences(9, 8) == 1


def test_alpaca_on_two_ranks_too_big_a_step_is_refused_before_launch(tmp_path, hf_tokenizer) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(400))
    args = [
        "tokenizer=hf", f"tokenizer.path={hf_tokenizer}", "data=jsonl", f"data.path={data}",
        "data.format=instruction", "data.seq_len=1024", "model.max_seq_len=1024", "train.micro_batch_size=32",
        *TWO_RANKS, f"run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "launcher", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 2, run.stderr
    assert not (tmp_path / "run").exists() and "Traceback" not in run.stderr
    message = " ".join(run.stderr.split())
    assert "the training data makes 42 sequences of 1024 tokens" in message  # 43,0xx tokens // 1024
    assert (
        "fewer than one optimizer step needs: 64 = train.micro_batch_size 32 x train.grad_accum_steps 1 x 2"
        in message
    )
    assert "Lower data.seq_len" in message and "lower train.micro_batch_size" in message
    assert (
        "the held-out data holds 1 sequence of 1024 tokens" in message
        and "fewer than the 2 data-parallel" in message
    )
    assert "data.val_fraction" in message and "train.eval_every=null" in message
    fits = [a for a in args if not a.startswith(("data.seq_len", "run_dir"))]
    assert size_errors(_spec(*fits, "data.seq_len=256", "data.val_fraction=0.1")) == []


def test_held_out_data_too_small_for_the_ranks_is_refused_and_evaluation_off_is_not(tmp_path) -> None:
    book = _book(tmp_path)
    args = ["data=text", f"data.path={book}", "data.seq_len=64", "data.val_fraction=0.002", *TWO_RANKS]
    (error,) = size_errors(_spec(*args))
    assert error.message.startswith(
        "the held-out data holds 1 sequence of 64 tokens (65 tokens from the tail"
    )
    assert cli.run([*args, f"run_dir={tmp_path / 'run'}"]) == 2 and not (tmp_path / "run").exists()
    assert size_errors(_spec(*args, "train.eval_every=null")) == []
    assert size_errors(_spec(*args, "data.val_fraction=0.05")) == []  # 848 tokens: 13 sequences


def test_unpacked_and_token_budget_batches_are_counted_as_the_ranks_cut_them(tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"record {i} " * 3} for i in range(120)])
    base = [
        "data=jsonl",
        f"data.path={data}",
        "data.seq_len=16",
        "data.packing=false",
        "train.eval_every=null",
    ]
    (error,) = size_errors(_spec(*base, "train.micro_batch_size=64", "train.grad_accum_steps=4"))
    assert "fewer than one optimizer step needs: 256 = train.micro_batch_size 64 x" in error.message
    assert "one per sequence" in error.message and "data.packing=true" in error.message
    assert size_errors(_spec(*base, "train.micro_batch_size=64")) == []
    budget = [*base, "data.batching=token_budget", "data.max_tokens_per_batch=512"]
    (error,) = size_errors(_spec(*budget, "train.grad_accum_steps=64"))
    assert "global micro batches" in error.message and "train.grad_accum_steps 64" in error.message
    assert size_errors(_spec(*budget, "train.grad_accum_steps=2")) == []


@pytest.mark.parametrize("kind", ["text", "files"])
def test_a_one_file_corpus_keeps_its_training_side_and_trains(tmp_path, kind: str) -> None:
    book = _book(tmp_path)
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        f"data={kind}",
        f"data.path={book}",
        "train.max_steps=3",
        "scheduler.warmup_steps=1",
        "train.eval_every=2",
        f"run_dir={run_dir}",
    ]
    spec = _spec(*args)
    assert prepare_data(spec) == []
    corpus = load_corpus(spec.data, spec.tokenizer)
    assert len(corpus.train) > 40 * len(corpus.val) > 0  # the hash would have held out the whole book
    assert cli.run(args) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_loss"] is not None


def test_a_run_that_makes_no_evaluation_needs_no_held_out_data(tmp_path) -> None:
    book = _book(tmp_path)
    args = ["data=text", f"data.path={book}", "data.seq_len=64", "data.val_fraction=0.002", *TWO_RANKS]
    short = [*args, "train.max_steps=10", "train.eval_every=100", "scheduler.warmup_steps=1"]
    assert size_errors(_spec(*short)) == []  # 10 steps, eval_every=100: no evaluation, not even at the end
    (error,) = size_errors(_spec(*short, "train.eval_at_end=true"))  # one evaluation asked for
    assert "the held-out data holds 1 sequence" in error.message
    (error,) = size_errors(_spec(*args, "train.max_steps=100", "train.eval_every=100"))  # step 100 evaluates
    assert "the held-out data holds 1 sequence" in error.message


def test_the_dry_run_runs_the_data_checks_and_says_what_the_run_would_refuse(tmp_path, capsys) -> None:
    book = _book(tmp_path)
    args = ["data=text", f"data.path={book}", "data.seq_len=64", "data.val_fraction=0.002", *TWO_RANKS]
    assert cli.run([*args, "dry_run=true", f"run_dir={tmp_path / 'run'}"]) == 2  # as the run itself
    out = " ".join(capsys.readouterr().out.split())
    assert "verdict: would be refused (1 problem(s) with the data)" in out and "verdict: valid" not in out
    assert "would be refused: data.val_fraction, data.val_path" in out
    assert "the held-out data holds 1 sequence of 64 tokens" in out
    assert "data check: refused (" in out and "s, tokenizing included)" in out
    assert not (tmp_path / "run").exists()
    assert cli.run([*args, "dry_run=true", "train.max_steps=10", "scheduler.warmup_steps=1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "data check: enough for one optimizer step (the run makes no evaluation)" in out
    assert "verdict: valid" in out

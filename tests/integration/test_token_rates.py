"""tokens_per_s counts what the model processed where that differs from what it trained: a preference run's
rate counts every row of both sides (its trained tokens are only the responses, trained_tokens_per_s beside
it); a plain run's rate stays its trained tokens, as documented."""

from __future__ import annotations

import json

import pytest
from data_assets import write_jsonl
from preference_assets import pair_records

from conftest import run_inline

QUICK = [
    "model=gpt_tiny", "data.seq_len=32", "train.max_steps=2", "train.log_every=1", "train.micro_batch_size=4",
    "train.eval_every=null", "checkpoint.every=null", "scheduler.warmup_steps=1", "log.progress=false",
    "log.summary_table=false",
]  # fmt: skip


def _records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_a_preference_run_counts_both_sides_and_reports_trained_tokens_beside(tmp_path) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(32))
    run_dir = tmp_path / "dpo"
    args = [*QUICK, "objective=dpo", "data=jsonl", "data.format=preference", f"data.path={data}"]
    assert run_inline([*args, f"run_dir={run_dir}"], run_dir) == 0
    for record in _records(run_dir):
        trained = record["trained_tokens_per_step"]
        processed = record["tokens_per_s"] / record["trained_tokens_per_s"] * trained  # the same seconds
        rows = 2 * 4  # 4 pairs: chosen and rejected rows, each as wide as the batch's longest side
        width = round(processed) // rows
        assert processed == pytest.approx(rows * width) and trained < processed and 0 < width <= 32, record


def test_a_plain_run_counts_its_trained_tokens(tmp_path) -> None:
    run_dir = tmp_path / "plain"
    assert run_inline([*QUICK, "data.max_bytes=100000", f"run_dir={run_dir}"], run_dir) == 0
    for record in _records(run_dir):
        assert record["tokens_per_s"] == record["trained_tokens_per_s"] > 0
        assert record["trained_tokens_per_step"] == 4 * 32  # packed: every token is trained

"""Context parallel (`parallel.cp_size`): each sequence split over the ranks of a cp group must train as one process.

Real gloo ranks, fp32, the tiny GPT, 3 steps: cp=2 alone (strategy single, 2 ranks) with packed
documents, and cp=2 x data-parallel 2 under FSDP2 (4 ranks, the shard mesh dp_shard x cp
flattened, with a held-out evaluation) must give one process's losses on the same global batch to
1e-5; a 2-rank run resumed from its step-2 checkpoint gives the straight run's step 3 bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_assets import text_records, write_jsonl

from conftest import TINY, losses, run_inline, run_ranks

BASE = [*TINY, "train.max_steps=3", "train.eval_every=null", "checkpoint.every=2", "scheduler.warmup_steps=1"]


def _ranks(args: list[str], run_dir: Path, nproc: int) -> dict[int, float]:
    proc = run_ranks(
        [*BASE, "launcher=local", f"launcher.nproc={nproc}", *args], run_dir, nproc=nproc, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(run_dir)


def _same(run: dict[int, float], reference: dict[int, float]) -> None:
    assert run.keys() == reference.keys() == {1, 2, 3}
    for step, loss in reference.items():
        assert run[step] == pytest.approx(loss, rel=1e-5), (step, run[step], loss)


def test_cp2_with_packed_documents_matches_one_process_and_resumes_bitwise(tmp_path) -> None:
    """cp=2 on 2 ranks: short documents (5 to 60 tokens) cross the chunk borders, attention stays inside each."""
    docs = write_jsonl(tmp_path / "docs.jsonl", text_records(300))
    packed = ["data=jsonl", f"data.path={docs}", "data.document_mask=true", "model.attention=sdpa"]
    one = tmp_path / "one"
    assert run_inline([*BASE, *packed], one) == 0
    straight = _ranks([*packed, "parallel.cp_size=2"], tmp_path / "straight", 2)
    _same(straight, losses(one))
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    resumed = _ranks([*packed, "parallel.cp_size=2", f"resume={step_2}"], tmp_path / "resumed", 2)
    assert resumed == {3: straight[3]}


def test_cp2_by_fsdp2_matches_one_process(tmp_path) -> None:
    """4 ranks: 2 data-parallel groups of 4 sequences, each sequence over 2 context-parallel ranks; held-out loss too."""
    held_out = ["train.eval_every=3", "train.eval_batches=1"]
    one = tmp_path / "one"
    assert run_inline([*BASE, *held_out, "train.micro_batch_size=8"], one) == 0
    _same(_ranks(["parallel=fsdp", "parallel.cp_size=2", *held_out], tmp_path / "cp", 4), losses(one))
    evals = [json.loads((run / "summary.json").read_text())["eval_loss"] for run in (one, tmp_path / "cp")]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5), evals

"""Context parallel (`parallel.cp_size`): each sequence split over the ranks of a cp group must train as one process.

Real gloo ranks, fp32, the tiny GPT on short packed documents (5 to 60 tokens, so documents cross
the chunk borders), 3 steps of a global batch of 8 sequences: cp=2 alone (strategy single, 2
ranks) and cp=2 x data-parallel 2 under FSDP2 (4 ranks, the shard mesh dp_shard x cp flattened,
with a held-out evaluation) must give one process's losses to 1e-5; a cp=2 run resumed from its
step-2 checkpoint gives the straight run's step 3 bitwise. One reference run serves both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_assets import text_records, write_jsonl

from conftest import TINY, assert_same_losses, losses, rank_losses, run_inline

BASE = [
    *TINY, "train.max_steps=3", "train.eval_every=3", "train.eval_batches=1", "checkpoint.every=2",
    "scheduler.warmup_steps=1", "data.document_mask=true", "model.attention=sdpa",
]  # fmt: skip


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> list[str]:
    """Short documents in a JSONL file: the data of every run here."""
    docs = write_jsonl(tmp_path_factory.mktemp("docs") / "docs.jsonl", text_records(300))
    return [*BASE, "data=jsonl", f"data.path={docs}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, packed: list[str]) -> Path:
    """One process, the whole global batch of 8 sequences per step."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert run_inline([*packed, "train.micro_batch_size=8"], run_dir) == 0
    return run_dir


def test_cp2_with_packed_documents_matches_one_process_and_resumes_bitwise(
    packed, reference, tmp_path
) -> None:
    """cp=2 on 2 ranks: attention stays inside each document across the chunk borders."""
    cp2 = [*packed, "train.micro_batch_size=8", "parallel.cp_size=2"]
    straight = rank_losses(cp2, tmp_path / "straight", 2)
    assert_same_losses(straight, losses(reference))
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    resumed = rank_losses([*cp2, f"resume={step_2}"], tmp_path / "resumed", 2)
    assert resumed == {3: straight[3]}


def test_cp2_by_fsdp2_matches_one_process(packed, reference, tmp_path) -> None:
    """4 ranks: 2 data-parallel groups of 4 sequences, each sequence over 2 cp ranks; the held-out loss too."""
    assert_same_losses(
        rank_losses([*packed, "parallel=fsdp", "parallel.cp_size=2"], tmp_path / "cp", 4), losses(reference)
    )
    evals = [
        json.loads((run / "summary.json").read_text())["eval_loss"] for run in (reference, tmp_path / "cp")
    ]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5), evals

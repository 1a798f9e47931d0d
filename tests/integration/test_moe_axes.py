"""The built-in GPT's MoE blocks on the other axes of the mesh: tensor parallel, pipelines, context parallel.

Real gloo ranks, fp32, model=gpt_moe_tiny made small, 3 steps of a global batch of 8 sequences, the
auxiliary and z losses and loss-free balancing on; each run's per-step losses (cross-entropy plus the
auxiliary losses) equal one process's to 1e-5. Default tier: `parallel=tp` on 2 ranks (attention split,
routers and experts whole on both ranks: the same tokens, the same routing). Extended: dense and MoE
blocks alternating with a shared expert (split like a dense MLP) under expert parallel x tensor parallel x
FSDP2 on 2 x 2 ranks, its checkpoint resumed in one process; pipeline stages each adding their own blocks'
auxiliary losses (launcher.parallel.pipeline_aux), and expert parallelism inside each stage; context
parallel with expert parallelism over the same ranks (each row's auxiliary sums added over the cp group).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, assert_same_losses, losses, rank_losses, run_inline
from launcher.components.metrics import read_metrics

BASE = [
    *TINY, "model=gpt_moe_tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.moe.d_ff=64",
    "model.moe.bias_update_rate=0.01", "train.max_steps=3", "train.eval_every=null", "checkpoint.every=2",
    "scheduler.warmup_steps=1",
]  # fmt: skip
MIXED = ["model.moe.every=2", "model.moe.shared_experts=1"]
"""Block 0 dense, block 1 an MoE block with a shared expert."""


def _one_process(args: list[str], run_dir: Path) -> dict[int, float]:
    assert run_inline([*args, "train.micro_batch_size=8"], run_dir) == 0
    return losses(run_dir)


def test_tensor_parallel_keeps_experts_whole_and_matches_one_process(tmp_path) -> None:
    """Both tp ranks route the same tokens: one process's losses and routing record, counted once."""
    reference = _one_process(BASE, tmp_path / "one")
    assert_same_losses(
        rank_losses([*BASE, "parallel=tp", "train.micro_batch_size=8"], tmp_path / "tp", 2), reference
    )
    records = [read_metrics(d / "metrics.jsonl")[-1] for d in (tmp_path / "tp", tmp_path / "one")]
    assert records[0]["moe_load/1"] == pytest.approx(records[1]["moe_load/1"])
    assert records[0]["moe_aux_loss"] == pytest.approx(records[1]["moe_aux_loss"], rel=1e-5)


@pytest.mark.extended  # the tp test above proves experts whole over the tp group; here EP splits them over dp
def test_expert_parallel_by_tensor_parallel_by_fsdp2_matches_one_process_and_resumes_at_ep1(tmp_path) -> None:
    """2 x 2 ranks: ep groups of the two data ranks sharing a tp coordinate; dense and MoE blocks alternate,
    the shared expert split like a dense MLP. The DCP checkpoint holds whole experts: one process resumes it."""
    reference = _one_process([*BASE, *MIXED], tmp_path / "one")
    args = [*BASE, *MIXED, "parallel=tp_fsdp", "parallel.ep_size=2", "train.micro_batch_size=4"]
    assert_same_losses(rank_losses(args, tmp_path / "ep_tp", 4), reference)
    step_2 = tmp_path / "ep_tp" / "checkpoints" / "step_2"
    resumed = _one_process([*BASE, *MIXED, f"resume={step_2}"], tmp_path / "ep1")
    assert resumed[3] == pytest.approx(reference[3], rel=1e-5)


@pytest.mark.extended  # the tp test above proves the routing record and losses; here stages hold the blocks
def test_pipeline_stages_add_their_own_auxiliary_losses(tmp_path) -> None:
    """2 stages: block 0 dense on the first, block 1 an MoE block with a shared expert on the last; the loss
    (auxiliary included), the routing record and the bias updates are one process's."""
    reference = _one_process([*BASE, *MIXED], tmp_path / "one")
    assert_same_losses(
        rank_losses([*BASE, *MIXED, "parallel=pp", "train.micro_batch_size=8"], tmp_path / "pp", 2), reference
    )
    records = [read_metrics(d / "metrics.jsonl")[-1] for d in (tmp_path / "pp", tmp_path / "one")]
    assert records[0]["moe_aux_loss"] == pytest.approx(records[1]["moe_aux_loss"], rel=1e-5)


@pytest.mark.extended  # the pipeline test above proves the stages' auxiliary losses; EP splits each stage's
def test_expert_parallel_inside_pipeline_stages_under_fsdp2(tmp_path) -> None:
    """2 stages of 2 ranks: each stage's MoE block split over its two data ranks, the first stage's auxiliary
    losses reaching the loss through its own backward."""
    reference = _one_process(BASE, tmp_path / "one")
    args = [*BASE, "parallel=pp_fsdp", "parallel.ep_size=2", "train.micro_batch_size=4"]
    assert_same_losses(rank_losses(args, tmp_path / "pp_ep", 4), reference)


@pytest.mark.extended  # the tp test above proves the per-row auxiliary losses on 2 ranks; here each row is split
def test_context_parallel_sums_each_rows_auxiliary_losses_with_expert_parallel(tmp_path) -> None:
    """cp 2 on 2 ranks, the experts split over the same two ranks: each rank routes its chunks of every
    sequence, the per-row sums are added over the cp group, the tokens travel to their experts."""
    reference = _one_process(BASE, tmp_path / "one")
    args = [*BASE, "parallel=fsdp", "parallel.cp_size=2", "parallel.ep_size=2", "train.micro_batch_size=8"]
    assert_same_losses(rank_losses(args, tmp_path / "cp_ep", 2), reference)
    records = [read_metrics(d / "metrics.jsonl")[-1] for d in (tmp_path / "cp_ep", tmp_path / "one")]
    assert records[0]["moe_aux_loss"] == pytest.approx(records[1]["moe_aux_loss"], rel=1e-5)
    assert records[0]["moe_load/1"] == pytest.approx(records[1]["moe_load/1"])

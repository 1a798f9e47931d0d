"""The built-in GPT with MoE blocks trains as one process under DDP and FSDP2, and resumes bitwise.

Real gloo ranks, fp32, model=gpt_moe_tiny made small, 3 steps of a global batch of 8 sequences, the
auxiliary and z losses and loss-free balancing on: 2 DDP ranks must give one process's per-step losses
(cross-entropy plus the auxiliary losses) to 1e-5, since the auxiliary losses are per sequence and the
bias update sums the step's expert counts over the ranks; resumed from its step-2 checkpoint (which holds
the routing biases) the DDP run gives the straight run's step 3 bitwise. FSDP2 on 2 ranks is the
extended variant of the same property.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, losses, run_inline, run_ranks
from launcher.components.metrics import read_metrics

BASE = [
    *TINY, "model=gpt_moe_tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.moe.d_ff=64",
    "model.moe.bias_update_rate=0.01", "train.max_steps=3", "train.eval_every=null", "checkpoint.every=2",
    "scheduler.warmup_steps=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process, the whole global batch of 8 sequences per step."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert run_inline([*BASE, "train.micro_batch_size=8"], run_dir) == 0
    return run_dir


def _ranks(args: list[str], run_dir: Path) -> dict[int, float]:
    proc = run_ranks([*args, "launcher=local", "launcher.nproc=2"], run_dir, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(run_dir)


def _same(run: dict[int, float], reference: dict[int, float]) -> None:
    assert run.keys() == reference.keys() == {1, 2, 3}
    for step, loss in reference.items():
        assert run[step] == pytest.approx(loss, rel=1e-5), (step, run[step], loss)


def test_moe_ddp_matches_one_process_and_resumes_bitwise(reference, tmp_path) -> None:
    ddp = [*BASE, "parallel=ddp", "train.micro_batch_size=4"]
    straight = _ranks(ddp, tmp_path / "straight")
    _same(straight, losses(reference))
    record = read_metrics(reference / "metrics.jsonl")[-1]
    assert record["moe_aux_loss"] > 0 and record["moe_load_max_over_mean"] >= 1.0
    assert record["moe_dropped_tokens"] == 0  # dropless
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    resumed = _ranks([*ddp, f"resume={step_2}"], tmp_path / "resumed")
    assert resumed == {3: straight[3]}


@pytest.mark.extended  # the DDP test above proves the property; FSDP2 shards the same blocks
def test_moe_fsdp_matches_one_process(reference, tmp_path) -> None:
    _same(_ranks([*BASE, "parallel=fsdp", "train.micro_batch_size=4"], tmp_path / "fsdp"), losses(reference))

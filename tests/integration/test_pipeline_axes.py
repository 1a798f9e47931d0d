"""Pipeline parallel as an axis: `parallel.pp_size=2` composed with FSDP2 and with DDP inside the stages.

Each layout runs 2 stages x 2 data-parallel ranks (4 gloo ranks, 4 sequences per data-parallel rank)
and must match one process with the same global batch of 8 (fp32: summation order only), and a run
resumed from its step-2 checkpoint must give the straight run's step 3 bitwise. A tiny 4-layer GPT
with a tied embedding and head, so the tie across stages is exercised too; 3 steps each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, losses, run_cli, run_inline, run_ranks

BASE = [
    *TINY, "model.n_layer=4", "train.max_steps=3", "train.eval_every=null", "checkpoint.every=2",
    "scheduler.warmup_steps=1",
]  # fmt: skip
LAYOUTS = {
    "fsdp": ["parallel=fsdp", "parallel.pp_size=2"],
    # two pipeline micro batches of 2: DDP's first-step bucket rebuild hung the ranks when every
    # micro batch's forward armed the reducer
    "ddp": ["parallel=ddp", "parallel.pp_size=2", "parallel.pp_microbatches=2"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """One process, the whole global batch of 8 sequences per step."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert run_inline([*BASE, "train.micro_batch_size=8"], run_dir) == 0
    return losses(run_dir)


def _four_ranks(args: list[str], run_dir: Path) -> dict[int, float]:
    proc = run_ranks([*BASE, "launcher=local", "launcher.nproc=4", *args], run_dir, nproc=4, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(run_dir)


# DDP inside the stages in the extended tier: FSDP2 inside the stages holds the axis (parity and bitwise resume on
# 4 ranks); DDP's own parity and resume: test_local_ddp.py.
@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.extended) if name == "ddp" else name for name in LAYOUTS]
)
def test_pipeline_axis_matches_one_process_and_resumes_bitwise(reference, tmp_path, layout: str) -> None:
    straight = _four_ranks(LAYOUTS[layout], tmp_path / "straight")
    assert straight.keys() == reference.keys() == {1, 2, 3}
    for step, loss in reference.items():
        assert straight[step] == pytest.approx(loss, rel=1e-5), (step, straight[step], loss)
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    resumed = _four_ranks([*LAYOUTS[layout], f"resume={step_2}"], tmp_path / "resumed")
    assert resumed == {3: straight[3]}


def test_deepspeed_with_a_pipeline_is_refused_before_launch(tmp_path) -> None:
    """DeepSpeed's engine owns the backward pass: pp_size > 1 exits 2, naming both keys, nothing started."""
    args = ["parallel=zero1", "parallel.pp_size=2", "launcher=local", "launcher.nproc=2", *TINY]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    out = " ".join((result.stdout + result.stderr).split())
    assert "parallel.strategy, parallel.pp_size" in out and "parallel.pp_size=1" in out, out[-2000:]
    assert not (tmp_path / "runs").exists()

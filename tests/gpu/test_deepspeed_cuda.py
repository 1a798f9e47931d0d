"""DeepSpeed on a CUDA device: fp16 loss scaling (refused on CPUs) and bf16 ZeRO-3 (skipped without a GPU)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, losses, run_ranks
from launcher.components.metrics import read_metrics
from launcher.parallel.deepspeed import consolidate

pytestmark = pytest.mark.gpu


def test_fp16_overflow_lowers_deepspeeds_loss_scale(tmp_path) -> None:
    """A 2**40 initial scale overflows at once: DeepSpeed skips those steps and halves the scale."""
    run_dir = tmp_path / "run"
    args = [*TINY, "launcher.device=cuda", "parallel=zero2", "precision=fp16", "precision.loss_scale_init=1099511627776",
            "train.max_steps=12", "checkpoint.every=null"]  # fmt: skip
    proc = run_ranks(args, run_dir, nproc=1, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert records[-1]["overflow_skips"] >= 1
    assert records[-1]["loss_scale"] < 2.0**40
    assert records[-1]["nonfinite_skips"] == 0


def test_bf16_zero3_trains_and_exports_on_cuda(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run_ranks(
        [*TINY, "launcher.device=cuda", "parallel=zero3", "precision=bf16"], run_dir, nproc=1, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    curve = losses(run_dir)
    assert curve[20] < curve[1] - 0.5
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "completed"
    state = consolidate(run_dir / "checkpoints" / "step_20")
    assert all(t.is_floating_point() and t.dtype.itemsize == 4 for t in state.values())

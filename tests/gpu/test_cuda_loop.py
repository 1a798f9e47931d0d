"""The loop on a CUDA device: precisions, loss scaling, MFU, no host sync per step (skipped without a GPU)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, losses, run_inline
from launcher.components.device import peak_flops
from launcher.components.metrics import read_metrics

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_precisions_train_on_cuda(tmp_path, precision: str) -> None:
    run_dir = tmp_path / precision
    assert run_inline([*TINY, "launcher.device=cuda", f"precision={precision}"], run_dir) == 0
    curve = losses(run_dir)
    assert curve[20] < curve[1] - 0.5
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    if peak_flops("cuda") is not None:  # a GPU in the data-sheet table
        assert records[-1]["mfu"] > 0
    if precision == "fp16":
        assert records[-1]["loss_scale"] is not None


def test_fused_adamw_skips_nonfinite_on_device(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY, "launcher.device=cuda", "optimizer.lr=1e12", "scheduler=constant", "scheduler.warmup_steps=0",
            "train.max_grad_norm=null", "train.max_nonfinite_skips=1000", "train.max_nonfinite_fraction=1",
            "checkpoint.every=null"]  # fmt: skip
    assert run_inline(args, run_dir) == 3  # skipped to the end; a non-finite final loss is never "completed"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nonfinite_skips"] >= 1 and summary["steps"] == 20

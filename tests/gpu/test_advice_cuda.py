"""The advisor's CUDA facts on a real GPU: the pre-launch memory check, fp32 on a bf16 GPU, reserved memory."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, run_cli, run_inline
from launcher.components.metrics import read_metrics

pytestmark = pytest.mark.gpu

# A ~13B-parameter GPT with whole fp32 Adam states on one rank: larger than any single GPU's memory.
HUGE = [
    "model.n_layer=64",
    "model.max_seq_len=2048",
    "model.d_model=4096",
    "model.n_head=32",
    "data.seq_len=2048",
    "train.micro_batch_size=4",
]


def test_a_plan_larger_than_the_gpu_is_refused_before_launch(tmp_path) -> None:
    result = run_cli([*HUGE, "launcher.device=cuda", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "exceeds the" in result.stderr and "of this GPU" in result.stderr
    assert "memory.activation_checkpointing=blocks: " in result.stderr and "(fits)" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started


def test_fp32_on_a_bf16_gpu_is_advised_and_reserved_memory_is_logged(tmp_path, capsys) -> None:
    args = [
        *TINY,
        "launcher.device=cuda",
        "train.max_steps=3",
        "train.eval_every=null",
        "checkpoint.every=null",
    ]
    assert run_inline([*args, "checkpoint.save_final=false"], tmp_path / "run") == 0
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert all(r["mem_reserved_bytes"] >= r["mem_peak_bytes"] > 0 for r in records)
    ids = [a["id"] for a in json.loads((tmp_path / "run" / "summary.json").read_text())["advice"]]
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert "fp32_on_bf16_gpu" in ids
        assert capsys.readouterr().out.count("advice: fp32_on_bf16_gpu") == 1
    else:
        assert "fp32_on_bf16_gpu" not in ids

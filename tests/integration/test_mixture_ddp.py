"""A two-source mixture on two real DDP ranks (`launcher=local`): per-source eval loss, and bitwise resume
across the small source's epoch boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_assets import write_jsonl

from conftest import TINY, losses, run_cli
from launcher.components.metrics import read_metrics


def _mixture(folder: Path) -> list[str]:
    """web: ~1,300 sequences of 32 tokens; code: ~5 (its held-out file: 4), so it wraps its epoch every few steps
    of 8 sequences."""
    web = write_jsonl(
        folder / "web.jsonl", [{"text": f"page {i}: " + "the web says hello. " * 7} for i in range(300)]
    )
    code = write_jsonl(
        folder / "code.jsonl", [{"text": f"def f{i}(x):\n    return x + {i}\n"} for i in range(6)]
    )
    held_out = write_jsonl(
        folder / "code_val.jsonl", [{"text": f"def g{i}(y):\n    return y * {i}\n"} for i in range(6)]
    )
    return [
        *TINY,
        f"data.sources=[{{path:{web},weight:0.7}},{{path:{code},weight:0.3,val_path:{held_out}}}]",
        "train.max_steps=10",
        "train.eval_every=5",
        "checkpoint.every=5",
        "launcher=local",
        "parallel=ddp",
        "launcher.nproc=2",
        "launcher.timeout_s=60",
    ]


def test_a_mixture_trains_on_two_ranks_and_resumes_bitwise(tmp_path) -> None:
    # The acceptance of data.sources: two launches of 2 ranks (straight; resumed from its step-5 checkpoint).
    args = _mixture(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run_cli([*args, f"run_dir={straight}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    step_5 = straight / "checkpoints" / "step_5"
    result = run_cli([*args, f"run_dir={resumed}", f"resume={step_5}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(losses(straight)) == set(range(1, 11))
    assert losses(resumed) == {step: loss for step, loss in losses(straight).items() if step > 5}
    records = read_metrics(straight / "metrics.jsonl")
    epochs = [r["epoch/code"] for r in records if "epoch/code" in r]
    assert epochs[4] >= 1 and epochs[-1] > epochs[4]  # code wrapped before the stop and again after it
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [5, 10]
    final = evals[-1]
    assert final["eval_loss"] == pytest.approx(0.7 * final["eval_loss/web"] + 0.3 * final["eval_loss/code"])
    resumed_evals = [r for r in read_metrics(resumed / "metrics.jsonl") if "eval_loss" in r]
    assert resumed_evals == [{**evals[1], "session": 1}]  # per-source eval losses bitwise too
    assert json.loads((resumed / "summary.json").read_text())["eval_loss"] == final["eval_loss"]

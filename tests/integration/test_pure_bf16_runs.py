"""Pure bf16 (precision=pure_bf16) in real runs: bf16 weights, gradients and moments after steps, exact
resume, DDP's 2 ranks against one process, FSDP2's 2 ranks holding half of it each, and eval_cast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY, losses, run_inline, run_ranks
from launcher.components.metrics import read_metrics

PURE = [*TINY, "precision=pure_bf16", "train.max_steps=6", "checkpoint.every=3", "train.eval_every=3"]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """One process, global batch 8: the reference of the tests below."""
    run_dir = tmp_path_factory.mktemp("pure") / "single"
    assert run_inline([*PURE, "train.micro_batch_size=8"], run_dir) == 0
    return run_dir


def _last_bytes(run_dir: Path) -> dict[str, int]:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "param_bytes" in r]
    return {key: records[-1][key] for key in ("param_bytes", "grad_bytes", "optimizer_bytes")}


def test_weights_gradients_and_moments_are_bf16_after_steps(single) -> None:
    step = single / "checkpoints" / "step_6"
    model = torch.load(step / "model.pt", weights_only=True)
    assert {t.dtype for t in model.values() if t.is_floating_point()} == {torch.bfloat16}
    state = torch.load(step / "optimizer.pt", weights_only=True)["state"]
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.bfloat16}
    num_params = sum(s["exp_avg"].numel() for s in state.values())  # a tied matrix once
    measured = _last_bytes(single)  # the real tensors of the run, as the metrics record them
    assert measured["param_bytes"] == measured["grad_bytes"] == 2 * num_params
    assert measured["optimizer_bytes"] == 4 * num_params + 4 * len(state)  # two bf16 moments, a float step


def test_resume_is_bitwise(single, tmp_path) -> None:
    """The rounding bits are seeded by (seed, step, parameter): a resumed run rounds as the straight one."""
    resumed = tmp_path / "resumed"
    resume = f"resume={single / 'checkpoints' / 'step_3'}"
    assert run_inline([*PURE, "train.micro_batch_size=8", resume], resumed) == 0
    want = {step: loss for step, loss in losses(single).items() if step > 3}
    assert losses(resumed) == want and set(want) == set(range(4, 7))


def test_ddp_two_ranks_match_one_process(single, tmp_path) -> None:
    """Micro 4 x 2 ranks against micro 8 x 1: the same rounding bits; the gradients differ by bf16's summation order."""
    run_dir = tmp_path / "ddp"
    proc = run_ranks([*PURE, "launcher=local", "launcher.nproc=2", "parallel=ddp"], run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two, one = losses(run_dir), losses(single)
    assert two.keys() == one.keys() == set(range(1, 7))
    for step in one:  # measured: within 2e-5
        assert two[step] == pytest.approx(one[step], rel=1e-4), (step, two[step], one[step])
    assert _last_bytes(run_dir) == _last_bytes(single)  # a full bf16 replica on each rank


FSDP = [*PURE, "launcher=local", "launcher.nproc=2", "parallel=fsdp"]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    """2 FSDP2 ranks, micro 4 each: the same global batch as `single`."""
    run_dir = tmp_path_factory.mktemp("pure") / "fsdp"
    proc = run_ranks(FSDP, run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def test_fsdp_two_ranks_hold_half_each_and_follow_one_process(single, fsdp) -> None:
    two, one = losses(fsdp), losses(single)
    assert two.keys() == one.keys()
    for step in one:  # measured: within 2e-4 (fp32 reduce-scatter, then bf16 shards)
        assert two[step] == pytest.approx(one[step], rel=1e-3), (step, two[step], one[step])
    sharded, whole = _last_bytes(fsdp), _last_bytes(single)
    assert sharded["param_bytes"] == pytest.approx(whole["param_bytes"] / 2, rel=0.02)  # bf16 shards
    assert sharded["grad_bytes"] == sharded["param_bytes"]
    assert sharded["optimizer_bytes"] == pytest.approx(whole["optimizer_bytes"] / 2, rel=0.02)


@pytest.mark.extended
def test_fsdp_resume_is_bitwise(fsdp, tmp_path) -> None:
    """The bf16 DTensor moments through a DCP checkpoint (test_resume_is_bitwise holds the rounding's part)."""
    resumed = tmp_path / "resumed"
    proc = run_ranks([*FSDP, f"resume={fsdp / 'checkpoints' / 'step_3'}"], resumed)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = {step: loss for step, loss in losses(fsdp).items() if step > 3}
    assert losses(resumed) == want and set(want) == set(range(4, 7))


def test_eval_cast_evaluates_on_bf16_weights_without_touching_training(tmp_path) -> None:
    """fp32 training with eval_cast: the training losses are bitwise those without it; the eval loss moves."""
    base = [*TINY, "train.max_steps=3", "train.eval_every=2", "precision.eval_dtype=bfloat16"]
    plain, cast = tmp_path / "plain", tmp_path / "cast"
    assert run_inline(base, plain) == 0
    assert run_inline([*base, "precision.eval_cast=true"], cast) == 0
    assert losses(cast) == losses(plain)  # the training weights never went through bf16
    evals = [
        [r["eval_loss"] for r in read_metrics(d / "metrics.jsonl") if "eval_loss" in r] for d in (plain, cast)
    ]
    assert len(evals[0]) == len(evals[1]) == 2 and evals[0] != evals[1]  # bf16 weights, not only autocast
    assert evals[1] == pytest.approx(evals[0], rel=1e-2)
    summary = json.loads((cast / "summary.json").read_text())
    assert summary["exit_reason"] == "completed"

"""The loop on real torch: loss falls, accumulation equivalence, exact resume, fallback, NaN and fp16 policies."""

from __future__ import annotations

import json
import math
import stat

import pytest
import torch

from conftest import TINY, losses, run_inline
from launcher.components import checkpoint
from launcher.components.metrics import read_metrics


def test_default_shape_run_leaves_the_run_directory(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert run_inline(TINY, run_dir) == 0
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for name in ("spec.yaml", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_20"
    assert [p.name for p in checkpoint.good_checkpoints(run_dir)] == ["step_20", "step_10"]
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "samples_per_s",
        "mfu",
        "mem_peak_bytes",
        "loss_scale",
    ):
        assert key in records[0], key
    assert records[0]["mfu"] is None  # no known peak on a CPU
    curve = losses(run_dir)
    assert curve[20] < curve[1] - 0.5  # byte-level LM: ~5.5 at init, clearly lower after 20 steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["exit_reason"] == "completed"
    assert summary["eval_loss"] is not None and summary["median_tokens_per_s"] > 0


def test_accumulation_matches_a_bigger_batch(tmp_path) -> None:
    base = [*TINY, "train.max_steps=6", "checkpoint.every=null", "train.eval_every=null"]
    assert run_inline([*base, "train.micro_batch_size=8", "train.grad_accum_steps=1"], tmp_path / "big") == 0
    assert run_inline([*base, "train.micro_batch_size=2", "train.grad_accum_steps=4"], tmp_path / "acc") == 0
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert big.keys() == acc.keys()
    for step in big:  # same update, summed in a different order: equal to float32 rounding
        assert acc[step] == pytest.approx(big[step], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["train.grad_accum_steps=3", "train.micro_batch_size=2"],
        ["data.max_bytes=2000", "train.micro_batch_size=8"],  # ~60 sequences: a new epoch every ~7 steps
    ],
    ids=["plain", "accumulation", "epoch-boundary"],
)
def test_resume_is_bitwise_exact(tmp_path, extra: list[str]) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_inline([*TINY, *extra], straight) == 0
    assert run_inline([*TINY, *extra, "train.stop_after=10"], split) == 0
    assert run_inline([*TINY, *extra, "resume=auto"], split) == 0
    assert losses(split) == losses(straight)  # bitwise: same floats, step by step


def test_corrupt_newest_checkpoint_falls_back(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert run_inline([*TINY, "checkpoint.every=5", "checkpoint.keep=3", "train.max_steps=15"], run_dir) == 0
    model = run_dir / "checkpoints" / "step_15" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])  # truncated, as by a crash or a full disk
    (run_dir / "checkpoints" / "step_10" / "COMPLETE").unlink()  # and one never marked complete
    with pytest.warns(UserWarning, match="step_15.*truncated"):
        good = checkpoint.good_checkpoints(run_dir)
    assert [p.name for p in good] == ["step_5"]
    straight = tmp_path / "straight"
    assert run_inline([*TINY, "train.max_steps=15"], straight) == 0
    assert run_inline([*TINY, "train.max_steps=15", "resume=auto"], run_dir) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_5")
    assert losses(run_dir)[15] == losses(straight)[15]


def test_fp16_overflow_skips_steps_and_lowers_the_scale(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "precision=fp16",
        "precision.loss_scale_init=1e12",
        "train.max_steps=12",
        "checkpoint.every=null",
    ]
    assert run_inline(args, run_dir) == 0
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert records[0]["overflow_skips"] >= 1
    assert records[-1]["loss_scale"] < 1e12
    scales = [r["loss_scale"] for r in records]
    assert scales == sorted(scales, reverse=True) or scales[-1] < scales[0]
    assert all(math.isfinite(r["loss"]) for r in records[-3:])


@pytest.mark.parametrize(
    ("policy", "kernel"),
    [("stop", "foreach"), ("skip", "foreach"), ("skip", "fused")],
    ids=["stop", "skip-host-check", "skip-on-device"],
)
def test_nonfinite_policy_never_updates_weights_with_nan(tmp_path, policy: str, kernel: str) -> None:
    """lr=1e12 makes the loss explode to inf/NaN within a few steps: a real non-finite, not a mock.

    The fused kernel skips on the device (no host read); foreach decides on the host. With `skip`
    the run goes on to the end (max_nonfinite_fraction=1 never stops on the share), but a run whose
    final loss is not finite never reports "completed": exit status 3 either way.
    """
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "optimizer.lr=1e12",
        f"optimizer.implementation={kernel}",
        "scheduler.warmup_steps=0",
        "scheduler=constant",
        f"train.on_nonfinite={policy}",
        "train.max_nonfinite_skips=1000",
        "train.max_nonfinite_fraction=1",
        "train.max_grad_norm=null",
        "checkpoint.every=null",
        "train.eval_every=null",
    ]
    assert run_inline(args, run_dir) == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nonfinite_skips"] >= 1
    assert summary["exit_reason"] == "nonfinite"
    assert summary["steps"] == (20 if policy == "skip" else summary["nonfinite_skips"] + 1)
    if policy == "skip":
        state = torch.load(run_dir / "checkpoints" / "step_20" / "model.pt", weights_only=True)
        assert all(torch.isfinite(t).all() for t in state.values())


def test_failed_save_keeps_the_previous_checkpoint(tmp_path) -> None:
    """A real write error (file size limit, as with a full disk) during a save."""
    import resource

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    checkpoint.save(run_dir, 1, lambda f: (f.directory / "a.bin").write_bytes(b"x" * 10_000), keep=2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(checkpoint.CheckpointSaveError, match="previous checkpoint .*step_1 is intact"):
            checkpoint.save(run_dir, 2, lambda f: (f.directory / "a.bin").write_bytes(b"y" * 10_000), keep=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert [p.name for p in checkpoint.good_checkpoints(run_dir)] == ["step_1"]
    assert not list((run_dir / "checkpoints").glob(".partial_*"))


def test_a_run_shorter_than_one_eval_interval_ends_without_evaluating(tmp_path) -> None:
    """eval_every=10, 3 steps: no end-of-run evaluation (train.eval_at_end=auto), the final checkpoint stays."""
    run_dir = tmp_path / "run"
    assert run_inline([*TINY, "train.max_steps=3"], run_dir) == 0
    assert not [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r]
    assert json.loads((run_dir / "summary.json").read_text())["eval_loss"] is None
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_3"

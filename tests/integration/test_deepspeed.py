"""DeepSpeed ZeRO 0-3 on real ranks (gloo, 2 processes): parity with one process, exact resume,
atomic checkpoints from every rank, consolidation, the non-finite guard and CPU offload.

Two-rank runs cost about 8-10 s each on an idle 2-core machine, so the runs are cached per module
and shared between tests: a stage's 20-step parity run is also the uninterrupted run its resume is
compared with, and the checkpoints whose atomicity and consolidation are checked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import TINY, assert_same_logits, losses, run_cli, run_inline, run_ranks
from launcher.components import checkpoint
from launcher.components.metrics import read_metrics
from launcher.front.cli import precheck
from launcher.parallel.deepspeed import TAG, consolidate

ACCUM = ["train.grad_accum_steps=2"]
# The spec says what run_ranks starts: two local ranks (checked by the world-size rules).
TWO_RANKS = ["launcher=local", "launcher.nproc=2"]
_runs: dict[tuple[str, ...], Path] = {}


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory):
    """Run (or reuse) a job: 2 ranks of the worker (ranks=2), `train` itself (inline backend: one rank in
    a fresh process) for ranks=1, or the worker in this process for ranks=0."""

    def run(args: list[str], ranks: int = 2) -> Path:
        key = (str(ranks), *args)
        if key not in _runs:
            run_dir = tmp_path_factory.mktemp("run") / "run"
            if ranks == 0:
                assert run_inline([*TINY, *args], run_dir) == 0
            elif ranks == 1:
                proc = run_cli([*TINY, *args, f"run_dir={run_dir}"], run_dir.parent, timeout=900)
                assert proc.returncode == 0, proc.stderr[-4000:]
            else:
                proc = run_ranks([*TINY, *TWO_RANKS, *args], run_dir, nproc=2, timeout=600)
                assert proc.returncode == 0, proc.stderr[-4000:]
            _runs[key] = run_dir
        return _runs[key]

    return run


def _reference(cached_run, extra: list[str]) -> dict[int, float]:
    """One process with the 2-rank job's global batch (micro batch 8 = 2 ranks x 4)."""
    return losses(cached_run(["train.micro_batch_size=8", *extra], ranks=0))


def _assert_close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), (step, got[step], want[step])


# zero0 in the extended tier: DeepSpeed's engine without partitioning is what zero1-3 add to, and those
# three hold the parity here (zero2's run is shared with the ZeRO-2 checkpoint test below).
@pytest.mark.parametrize(
    ("option", "extra"),
    [
        pytest.param("zero0", [], id="zero0", marks=pytest.mark.extended),
        pytest.param("zero1", ACCUM, id="zero1-accum2"),
        pytest.param("zero2", [], id="zero2"),
        pytest.param("zero3", [], id="zero3"),
    ],
)
def test_fp32_losses_match_one_process(cached_run, option: str, extra: list[str]) -> None:
    """Same global batch, same init and data: equal up to fp32 summation order."""
    got = losses(cached_run([f"parallel={option}", *extra]))
    _assert_close(got, _reference(cached_run, extra), rel=1e-5)


# In the extended tier: bf16 closeness to one process is held by test_fsdp_tp.py's and test_pipeline.py's bf16
# runs, and the bf16 section DeepSpeed gets by tests/unit/test_deepspeed_config.py; ZeRO-3's arithmetic here is
# DeepSpeed's own.
@pytest.mark.extended
def test_bf16_zero3_is_close_to_one_process_bf16(cached_run) -> None:
    """Not bitwise: ZeRO-3 bf16 computes with bf16 weights and reduces bf16 gradients (fp32 masters
    live in the optimizer), while one process autocasts over fp32 weights and keeps fp32 gradients.
    Measured: 8.9e-4 relative at most over these 20 steps (bf16 keeps 8 bits of mantissa, ~4e-3
    per rounding); 5e-3 leaves room for other machines' kernels without hiding a wrong update."""
    got = losses(cached_run(["parallel=zero3", "precision=bf16"]))
    _assert_close(got, _reference(cached_run, ["precision=bf16"]), rel=5e-3)


def test_zero3_reports_this_ranks_share_of_the_state(cached_run) -> None:
    """Per rank, ZeRO-3 holds half the parameters and half the optimizer moments plus half the fp32
    masters: about 10 of one process's 16 bytes per parameter (fp32 AdamW) at 2 ranks."""
    first = [r for r in read_metrics(cached_run(["parallel=zero3"]) / "metrics.jsonl") if "loss" in r][0]
    one = [
        r
        for r in read_metrics(cached_run(["train.micro_batch_size=8"], ranks=0) / "metrics.jsonl")
        if "loss" in r
    ][0]
    assert first["param_bytes"] == pytest.approx(one["param_bytes"] / 2, rel=0.05)
    total = sum(first[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    total_one = sum(one[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    assert total == pytest.approx(total_one * 10 / 16, rel=0.05)


# zero2 in the extended tier: zero3 holds exact resume over the same checkpoint files with partitioned
# parameters as well; zero2's checkpoint is still read back by test_zero2_checkpoint_continues_...
@pytest.mark.parametrize("option", [pytest.param("zero2", marks=pytest.mark.extended), "zero3"])
def test_resume_is_exact(cached_run, tmp_path, option: str) -> None:
    """A new run resumed from the straight run's step-10 checkpoint gives its steps 11-20 bitwise."""
    straight = cached_run([f"parallel={option}"])
    step_10 = straight / "checkpoints" / "step_10"
    wrong_world = precheck([*TINY, f"parallel={option}", f"run_dir={tmp_path / 'one'}", f"resume={step_10}"])
    assert [e.keys for e in wrong_world] == [("resume", "launcher.nproc")]  # 2 shards, 1 rank: refused
    resumed = tmp_path / "resumed"
    second = run_ranks([*TINY, *TWO_RANKS, f"parallel={option}", f"resume={step_10}"], resumed, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    want = {step: loss for step, loss in losses(straight).items() if step > 10}
    assert losses(resumed) == want and set(want) == set(range(11, 21))  # bitwise, step by step
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == str(step_10)


def test_checkpoint_holds_every_rank_and_latest_follows_complete_saves(cached_run) -> None:
    run_dir = cached_run(["parallel=zero3"])
    root = checkpoint.root(run_dir)
    good = checkpoint.good_checkpoints(run_dir)
    assert [p.name for p in good] == ["step_20", "step_10"]
    assert (root / checkpoint.LATEST).read_text().strip() == "step_20"
    # every step directory is complete (written under .partial_*, marked, then renamed)
    assert sorted(p.name for p in checkpoint.step_dirs(run_dir)) == ["step_10", "step_20"]
    assert not list(root.glob(f"{checkpoint.PARTIAL_PREFIX}*"))
    for path in good:
        manifest = json.loads((path / checkpoint.MARKER).read_text())["files"]
        shards = [name for name in manifest if name.startswith(f"{TAG}/zero_pp_rank_") and "optim" in name]
        assert len(shards) == 2, manifest  # both ranks wrote their shard before the marker
        assert not (path / "latest").exists()  # DeepSpeed's own pointer is not used


# zero0 in the extended tier: zero3 (weights partitioned over the ranks) is the case consolidation must gather.
@pytest.mark.parametrize("option", [pytest.param("zero0", marks=pytest.mark.extended), "zero3"])
def test_consolidated_weights_load_at_world_size_one(cached_run, option: str) -> None:
    run_dir = cached_run([f"parallel={option}"])
    reference_dir = cached_run(["train.micro_batch_size=8"], ranks=0)
    assert_same_logits(consolidate(run_dir / "checkpoints" / "step_20"), run_dir, reference_dir)


# zero0 in the extended tier: zero2 holds the skip on every rank with partitioned gradients and states.
@pytest.mark.parametrize("option", [pytest.param("zero0", marks=pytest.mark.extended), "zero2"])
def test_nonfinite_steps_are_skipped_on_every_rank(tmp_path, option: str) -> None:
    """lr=1e12 makes the loss explode to inf/NaN within a few steps: a real non-finite, not a mock.
    Every rank skips those steps and the run goes on to the end, which then reports "nonfinite"
    (exit status 3, through torchrun a failure) because its final loss is not finite."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        *TWO_RANKS,
        f"parallel={option}",
        "optimizer.lr=1e12",
        "scheduler=constant",
        "scheduler.warmup_steps=0",
        "train.max_steps=8",
        "train.max_nonfinite_skips=1000",
        "train.max_grad_norm=null",
        "train.eval_every=null",
        "checkpoint.every=null",
    ]
    run_ranks(args, run_dir, timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nonfinite_skips"] >= 1 and summary["exit_reason"] == "nonfinite" and summary["steps"] == 8
    state = consolidate(run_dir / "checkpoints" / "step_8")
    assert all(torch.isfinite(t).all() for t in state.values())


# In the extended tier: tests/unit/test_deepspeed_config.py holds train.max_grad_norm becoming DeepSpeed's
# gradient_clipping (null: 0), the parity tests here run DeepSpeed's engine with that section, and the clip by
# the all-rank norm is DeepSpeed's own arithmetic (the launcher's own clip by a global norm: test_pipeline.py).
@pytest.mark.extended
def test_max_grad_norm_reaches_deepspeed(cached_run) -> None:
    """train.max_grad_norm becomes DeepSpeed's gradient_clipping: with a bound that clips every step,
    ZeRO-2 matches one process that clips the same way, and differs from the unclipped run. SGD,
    because Adam's update hardly depends on a uniform scale of the gradients (measured: clipping at
    0.05 vs 1.0 moved AdamW's losses by 3e-5 relative only)."""
    sgd = ["optimizer=sgd", "optimizer.lr=0.1"]
    clip = [*sgd, "train.max_grad_norm=0.05"]
    run_dir = cached_run(["parallel=zero2", *clip])
    got = losses(run_dir)
    _assert_close(got, _reference(cached_run, clip), rel=1e-5)
    norms = [r["grad_norm"] for r in read_metrics(run_dir / "metrics.jsonl") if "grad_norm" in r]
    assert min(norms) > 0.05  # the global norm before clipping: the bound was active at every step
    unclipped = _reference(cached_run, [*sgd, "train.max_grad_norm=null"])  # one process: no 2-rank launch
    assert max(abs(got[s] - unclipped[s]) / unclipped[s] for s in got) > 1e-2


# In the extended tier: test_nonfinite_steps_are_skipped_on_every_rank[zero2] holds ZeRO-2's ranks meeting the same
# non-finite steps together, test_engine.py's [stop] case the policy's exit 3 with no NaN saved, and test_step_inputs.py
# the step's terms and a stop agreed by every rank in one all-reduce.
@pytest.mark.extended
def test_nonfinite_stop_policy_ends_deepspeed_like_one_process(tmp_path) -> None:
    """train.on_nonfinite=stop: exit status 3 and exit reason nonfinite, at the same step as one
    process, with no NaN in the last checkpoint (the same policy as every other strategy)."""
    args = [
        *TINY,
        "optimizer.lr=1e12",
        "scheduler=constant",
        "scheduler.warmup_steps=0",
        "train.max_steps=8",
        "train.on_nonfinite=stop",
        "train.max_grad_norm=null",
        "train.eval_every=null",
        "checkpoint.every=1",
    ]
    one = tmp_path / "one"
    assert run_inline([*args, "train.micro_batch_size=8"], one) == 3
    ds = tmp_path / "ds"
    proc = run_cli([*args, *TWO_RANKS, "parallel=zero2", f"run_dir={ds}"], tmp_path, timeout=600)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-4000:]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (one, ds)]
    assert [s["exit_reason"] for s in summaries] == ["nonfinite", "nonfinite"]
    assert summaries[0]["steps"] == summaries[1]["steps"], summaries
    newest = checkpoint.good_checkpoints(ds)[0]
    assert all(torch.isfinite(t).all() for t in consolidate(newest).values())


# In the extended tier: ZeRO-3's partitioned parity is held by test_fp32_losses_match_one_process[zero3], and
# the offload settings reaching DeepSpeed's config by tests/unit/test_deepspeed_config.py; this run adds
# DeepSpeedCPUAdam's JIT build (about a minute on a clean machine).
@pytest.mark.extended
def test_zero3_offload_through_train_matches_one_process(cached_run) -> None:
    """Parameters and optimizer state in CPU memory, AdamW as DeepSpeedCPUAdam (JIT-built once, then
    cached in TORCH_EXTENSIONS_DIR). Run as a user would: `train` with the inline backend, one rank
    in that process with a private one-rank process group."""
    args = [
        "parallel=zero3_offload",
        "train.micro_batch_size=8",
        "train.max_steps=10",
        "checkpoint.every=null",
    ]
    got = losses(cached_run(args, ranks=1))
    want = losses(
        cached_run(["train.micro_batch_size=8", "train.max_steps=10", "checkpoint.every=null"], ranks=0)
    )
    # DeepSpeedCPUAdam's vectorized update against torch's AdamW: measured 2.1e-7 relative at most.
    _assert_close(got, want, rel=1e-5)
    assert all(math.isfinite(v) for v in got.values())


def test_zero2_checkpoint_continues_in_one_process_with_its_weights(cached_run, tmp_path: Path) -> None:
    """DeepSpeed -> single at world size 1 (launcher.parallel.state_convert): the fp32 weights carry over,
    so step 11's loss (its forward runs before any update) equals the ZeRO run's; the optimizer state
    restarts from zero, with a warning that says so, and step 12 departs from the ZeRO run."""
    run_dir = cached_run(["parallel=zero2"])
    resumed = tmp_path / "single"
    argv = [*TINY, "train.micro_batch_size=8", f"resume={run_dir / 'checkpoints' / 'step_10'}"]
    with pytest.warns(UserWarning, match=r"optimizer state .* restarts from zero"):
        assert run_inline(argv, resumed) == 0
    got, want = losses(resumed), losses(run_dir)
    assert got[11] == pytest.approx(want[11], rel=1e-5)
    assert got[12] != pytest.approx(want[12], rel=1e-5)

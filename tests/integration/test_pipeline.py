"""Pipeline parallel (strategy pp) on real ranks (gloo): every schedule's per-step losses against one
process, FSDP2 and tensor parallel inside stages, fp16 across stages, exact resume, export.

All runs share one tiny 4-layer GPT (tied embedding and head, so the tie across stages is exercised)
and 6 steps with a global batch of 8 sequences. Two-rank runs take about 8-10 s on the 2 cores; runs
are cached per module so a parity run is also the uninterrupted run a resume is compared with.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, losses, run_cli, run_inline, run_ranks
from launcher.components.metrics import read_metrics

BASE = [*TINY, "model.n_layer=4", "train.max_steps=6", "train.micro_batch_size=8", "checkpoint.every=3",
        "train.eval_at_end=true"]  # fmt: skip
SCHEDULES = {
    "gpipe": ["parallel.pp_schedule=gpipe"],
    "1f1b": ["parallel.pp_schedule=1f1b"],
    "interleaved_1f1b": ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
    "zero_bubble": ["parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2"],
}
_runs: dict[tuple[str, ...], Path] = {}


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory):
    """Run (or reuse) a job on `ranks` real ranks, or one process inline for ranks=0."""

    def run(args: list[str], ranks: int = 2) -> Path:
        key = (str(ranks), *args)
        if key not in _runs:
            run_dir = tmp_path_factory.mktemp("run") / "run"
            if ranks == 0:
                assert run_inline([*BASE, *args], run_dir) == 0
            else:
                extra = ["launcher=local", f"launcher.nproc={ranks}"]
                proc = run_ranks([*BASE, *extra, *args], run_dir, nproc=ranks, timeout=600)
                assert proc.returncode == 0, proc.stderr[-4000:]
            _runs[key] = run_dir
        return _runs[key]

    return run


def _assert_close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), (step, got[step], want[step])


def _eval_loss(run_dir: Path) -> float:
    return [r["eval_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r][-1]


# gpipe in the extended tier: 1f1b, interleaved_1f1b and zero_bubble hold the parity of torch's schedules over
# the same stages (gpipe is the simplest of them: every forward, then every backward).
@pytest.mark.parametrize(
    "schedule", [pytest.param(s, marks=pytest.mark.extended) if s == "gpipe" else s for s in SCHEDULES]
)
def test_every_schedule_matches_one_process(cached_run, schedule: str) -> None:
    """fp32, same init and global batch: equal up to summation order (measured ~1e-7 relative), eval too."""
    reference = cached_run([], ranks=0)
    run = cached_run(["parallel=pp", *SCHEDULES[schedule]])
    _assert_close(losses(run), losses(reference), rel=1e-5)
    assert _eval_loss(run) == pytest.approx(_eval_loss(reference), rel=1e-5)


def _grad_norms(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_metrics(run_dir / "metrics.jsonl") if "grad_norm" in r}


def test_accumulation_and_checkpointing_stay_token_exact_and_clip_by_the_global_norm(cached_run) -> None:
    """2 accumulated pipeline steps of 4 sequences (2 pipeline micro batches each), blocks recomputed:
    the one-process losses, and the same global gradient norm (the tied matrix counted once)."""
    reference = cached_run([], ranks=0)
    run = cached_run(
        [
            "parallel=pp", "parallel.pp_microbatches=2", "train.micro_batch_size=4", "train.grad_accum_steps=2",
            "memory.activation_checkpointing=blocks", "train.max_grad_norm=0.5",
        ]
    )  # fmt: skip
    clipped = cached_run(["train.max_grad_norm=0.5"], ranks=0)
    _assert_close(losses(run), losses(clipped), rel=1e-5)
    _assert_close(_grad_norms(run), _grad_norms(clipped), rel=1e-5)
    assert losses(clipped) != losses(reference)  # the clip really acted


def test_bf16_follows_one_process(cached_run) -> None:
    """Autocast per stage, activations passed between ranks in float32: bf16 rounding only (measured ~3e-5)."""
    reference = cached_run(["precision=bf16"], ranks=0)
    _assert_close(losses(cached_run(["parallel=pp", "precision=bf16"])), losses(reference), rel=1e-3)


def test_nonfinite_steps_are_skipped_on_every_stage(tmp_path) -> None:
    """lr=1e12 blows the loss up on the last stage; every stage skips the same steps and the kept
    checkpoint holds finite weights (a stage stepping alone would diverge or hang the pipeline)."""
    from launcher.components import checkpoint
    from launcher.parallel.part_state import consolidate

    args = [
        *BASE, "launcher=local", "launcher.nproc=2", "parallel=pp", "optimizer.lr=1e12", "scheduler=constant",
        "scheduler.warmup_steps=0", "train.max_nonfinite_skips=1000", "train.max_grad_norm=null",
        "train.eval_every=null", "checkpoint.every=null",
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    run_ranks(args, run_dir, timeout=600)  # exit status 3 in each rank
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nonfinite_skips"] >= 1 and summary["exit_reason"] == "nonfinite" and summary["steps"] == 6
    for final in checkpoint.good_checkpoints(run_dir):
        assert all(torch.isfinite(t).all() for t in consolidate(final).values())


@pytest.mark.parametrize(
    ("ranks", "micro_batch"),
    [
        (4, 8),  # 2 stages x 2 tensor-parallel ranks: the whole batch of 8 through each stage pair
        # 2 x 2 data-parallel x 2 tensor-parallel (8 processes on 2 cores): every pair of these axes is
        # held by the default suite (this test's 4-rank case, test_pipeline_axes.py's pp x FSDP2 on 4
        # ranks, test_hf_pretrained.py's tp_fsdp on 2 x 2), so the 3-D run is in the extended tier.
        pytest.param(8, 4, marks=pytest.mark.extended),
    ],
    ids=["pp_tp-4", "pp_tp_fsdp-8"],
)
def test_pipeline_with_fsdp_and_tensor_parallel_matches_one_process(cached_run, ranks, micro_batch) -> None:
    """The pp_tp_fsdp preset against one process with the same global batch of 8 sequences, 3 steps."""
    reference = losses(cached_run([], ranks=0))
    args = ["parallel=pp_tp_fsdp", f"train.micro_batch_size={micro_batch}", "train.stop_after=3"]
    got = losses(cached_run(args, ranks=ranks))
    assert sorted(got) == [1, 2, 3]
    _assert_close(got, {step: reference[step] for step in got}, rel=1e-5)


def test_fp16_loss_scale_agrees_across_stages(cached_run) -> None:
    """One scale for every stage (only the last one scales a loss): losses follow the one-process fp16 run."""
    reference = cached_run(["precision=fp16"], ranks=0)
    run = cached_run(["parallel=pp", "precision=fp16"])
    _assert_close(losses(run), losses(reference), rel=1e-4)
    scales = {r["loss_scale"] for r in read_metrics(run / "metrics.jsonl") if "loss_scale" in r}
    assert len(scales) == 1 and scales != {None}


def test_resume_across_stage_layouts(cached_run, tmp_path) -> None:
    """The straight 2-stage (1f1b) run's step-3 checkpoint, resumed to 6 as 4 interleaved stages: the
    checkpoint holds the whole model's names, so the new layout reads it. Against six straight interleaved
    steps the run that changed layouts is close, not bitwise: its first three gradients were summed in
    1f1b's order. Bitwise where the arithmetic is the same: the straight interleaved run's own step-3
    checkpoint resumed on its layout gives its steps 4-6."""
    straight = cached_run(["parallel=pp", *SCHEDULES["interleaved_1f1b"]])
    step_3 = cached_run(["parallel=pp", *SCHEDULES["1f1b"]]) / "checkpoints" / "step_3"
    interleaved = [*BASE, "launcher=local", "launcher.nproc=2", "parallel=pp", *SCHEDULES["interleaved_1f1b"]]
    changed, same = tmp_path / "changed_layout", tmp_path / "same_layout"
    for proc in (
        run_ranks([*interleaved, f"resume={step_3}"], changed),
        run_ranks([*interleaved, f"resume={straight / 'checkpoints' / 'step_3'}"], same),
    ):
        assert proc.returncode == 0, proc.stderr[-3000:]
    want = {step: loss for step, loss in losses(straight).items() if step > 3}
    assert set(want) == {4, 5, 6} and losses(same) == want  # bitwise, step by step
    _assert_close(losses(changed), want, rel=1e-6)


@pytest.mark.extended  # verify_resume's phases and verdict: test_local_ddp.py's [inline] case; a pipeline
# resuming bitwise on its own layout: test_resume_across_stage_layouts
def test_verify_resume_passes_for_a_pipeline(tmp_path) -> None:
    """The product's own check on the default schedule (1f1b): 6 straight vs 3 + resume, bitwise."""
    args = [
        *BASE, "launcher=local", "launcher.nproc=2", "parallel=pp", "train.eval_every=null",
        "checkpoint.every=null", "verify_resume=true", "log.progress=false", f"run_dir={tmp_path / 'check'}",
    ]  # fmt: skip
    result = run_cli(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical: all 6 per-step losses are bitwise equal. PASS" in " ".join(result.stdout.split())


def test_export_consolidates_the_stages_into_the_whole_model(cached_run, tmp_path) -> None:
    """The exported state dict loads strictly into the one-process model and gives its logits."""
    from launcher.components.model.build import build_model
    from launcher.spec import load_spec

    run = cached_run(["parallel=pp", *SCHEDULES["zero_bubble"]])  # V-shaped: rank 0 holds both ends
    out = tmp_path / "model.pt"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.tools.export", str(run), str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    state = torch.load(out, weights_only=True)
    assert torch.equal(state["tok_emb.weight"], state["lm_head.weight"])  # the tied copies stayed equal
    spec = load_spec(run / "spec.yaml")
    model, single = build_model(spec.model), build_model(spec.model)
    model.load_state_dict(state, strict=True)
    reference = cached_run([], ranks=0) / "checkpoints" / "step_6" / "model.pt"
    single.load_state_dict(torch.load(reference, weights_only=True))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), single(tokens), rtol=1e-4, atol=1e-4)


def test_a_llama_folder_is_pipelined(tmp_path_factory) -> None:
    """A Hugging Face Llama (2 layers, untied) on 2 stages: the one-process losses."""
    pytest.importorskip("transformers")
    from hf_assets import make_hf_model

    root = tmp_path_factory.mktemp("llama")
    folder = make_hf_model("llama", root / "llama")
    args = ["model=hf", f"model.path={folder}", "train.eval_every=null", "checkpoint.every=null"]
    reference = root / "single"
    assert run_inline([*BASE, *args], reference) == 0
    run_dir = root / "pp"
    proc = run_ranks([*BASE, *args, "launcher=local", "launcher.nproc=2", "parallel=pp"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_close(losses(run_dir), losses(reference), rel=1e-5)
    shutil.rmtree(root, ignore_errors=True)


def test_resuming_a_non_pipeline_checkpoint_with_pp_is_refused(cached_run, tmp_path) -> None:
    """Checkpoint formats differ (one optimizer per model vs per stage): the export hint, before any rank starts."""
    run_dir = tmp_path / "run"
    shutil.copytree(cached_run([], ranks=0), run_dir)
    args = [*BASE, "launcher=local", "launcher.nproc=2", "parallel=pp", "resume=auto", f"run_dir={run_dir}"]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 2
    assert "train-export" in " ".join(result.stderr.split() + result.stdout.split())

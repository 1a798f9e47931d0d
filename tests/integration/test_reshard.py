"""Resume on another world size and under another strategy, on real ranks (gloo), tiny GPT, 8 steps.

The reference is the uninterrupted 2-rank FSDP2 run the checkpoint came from: a resume at the same
size is bitwise equal to it (test_fsdp_tp.py), and every layout below reads the same global batches
(8 sequences per step), so a run resumed from its step-4 checkpoint on any layout must give its
losses of steps 5-8 up to fp32 summation order (1e-5). A wrong data position (a repeated or skipped
batch), a lost optimizer state or a wrongly sharded weight moves the loss by far more within a step.

One 2-rank FSDP2 run (checkpoints at steps 2, 4, 6, 8) is shared by every test; the DDP case resumes
the files checkpoint that a DDP resume of it wrote (step 6) under FSDP2 again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, losses, run_inline, run_ranks

STEPS = ["train.max_steps=8", "checkpoint.every=2", "checkpoint.keep=4", "train.eval_every=null"]
RANKS2 = ["launcher=local", "launcher.nproc=2"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """2-rank FSDP2, micro batch 4: 8 sequences per step, a DCP checkpoint every 2 steps."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    proc = run_ranks([*TINY, *STEPS, *RANKS2, "parallel=fsdp"], run_dir, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def _assert_continues(resumed: Path, reference: Path, start: int) -> None:
    got, want = losses(resumed), losses(reference)
    assert sorted(got) == list(range(start + 1, 9)), got
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5), (step, loss, want[step])
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{start}")


def test_fsdp_on_two_ranks_resumes_on_four(fsdp_run: Path, tmp_path: Path) -> None:
    """DCP reshards to 4 ranks; ranks 2 and 3 have no saved RNG state and get the derived one."""
    resumed = tmp_path / "four"
    argv = [*TINY, *STEPS, "parallel=fsdp", "launcher=local", "launcher.nproc=4", "train.micro_batch_size=2"]
    argv.append(f"resume={_step(fsdp_run, 4)}")
    proc = run_ranks(argv, resumed, nproc=4, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_continues(resumed, fsdp_run, 4)
    assert json.loads((resumed / "summary.json").read_text())["world_size"] == 4
    assert sorted(p.name for p in _step(resumed, 8).glob("rng_rank*.pt")) == [
        f"rng_rank{r}.pt" for r in range(4)
    ]


def test_fsdp_checkpoint_resumes_in_one_unsharded_process(fsdp_run: Path, tmp_path: Path) -> None:
    """Strategy single at world size 1 reads the DCP shards into the whole model and its optimizer."""
    resumed = tmp_path / "single"
    argv = [*TINY, *STEPS, "parallel=single", "train.micro_batch_size=8", f"resume={_step(fsdp_run, 4)}"]
    assert run_inline(argv, resumed) == 0
    _assert_continues(resumed, fsdp_run, 4)
    assert (_step(resumed, 8) / "model.pt").is_file()  # written in its own layout


def test_ddp_checkpoint_resumes_under_fsdp(fsdp_run: Path, tmp_path: Path) -> None:
    """FSDP2 -> DDP (step 4 to 6, model.pt + optimizer.pt), then DDP -> FSDP2 (rank 0 reads, all shard)."""
    ddp = tmp_path / "ddp"
    argv = [*TINY, *STEPS, *RANKS2, "parallel=ddp", "train.stop_after=6", f"resume={_step(fsdp_run, 4)}"]
    proc = run_ranks(argv, ddp, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (_step(ddp, 6) / "optimizer.pt").is_file() and not (_step(ddp, 6) / "dcp").exists()
    back = tmp_path / "back"
    proc = run_ranks(
        [*TINY, *STEPS, *RANKS2, "parallel=fsdp", f"resume={_step(ddp, 6)}"], back, nproc=2, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_continues(back, fsdp_run, 6)
    assert losses(ddp) == pytest.approx({s: losses(fsdp_run)[s] for s in (5, 6)}, rel=1e-5)

"""Long-sequence options in real runs: exact resume, two FSDP2 ranks against one process, flex refused on CPU."""

from __future__ import annotations

from conftest import TINY, losses, run_cli, run_inline, run_ranks

LONG = [
    "model.attention=varlen",
    "train.loss_chunks=4",
    "memory.activation_checkpointing=selective",
    "memory.selective_matmuls=every_other",
    "train.max_steps=6",
    "checkpoint.every=3",
    "train.eval_every=null",
]


def test_varlen_chunked_selective_run_resumes_bitwise(tmp_path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_inline([*TINY, *LONG], straight) == 0
    assert run_inline([*TINY, *LONG, "train.stop_after=3"], split) == 0
    assert run_inline([*TINY, *LONG, "resume=auto"], split) == 0
    assert losses(split) == losses(straight)  # bitwise, step by step


def test_two_fsdp_ranks_match_one_process(tmp_path) -> None:
    """FSDP2 (the root kept gathered for the chunked head) over 2 gloo ranks: one process's losses (same global batch)."""
    args = [*TINY, *LONG, "checkpoint.every=null", "train.max_steps=4"]
    assert run_inline([*args, "train.micro_batch_size=8"], tmp_path / "one") == 0
    result = run_ranks([*args, "parallel=fsdp", "launcher.nproc=2"], tmp_path / "two")
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert one.keys() == two.keys()
    assert all(abs(two[s] - one[s]) <= 1e-5 * abs(one[s]) for s in one), (one, two)


def test_flex_on_cpu_is_refused_before_launch(tmp_path) -> None:
    """FlexAttention's backward is CUDA-only in torch 2.13: a CPU run with model.attention=flex exits 2, nothing started."""
    result = run_cli([*TINY, "model.attention=flex", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "model.attention" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

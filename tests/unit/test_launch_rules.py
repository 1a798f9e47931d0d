"""Rules of multi-process jobs, DDP options and verify_resume: each bad input named with its fix."""

from __future__ import annotations

import pytest

from launcher.front.cli import precheck
from launcher.front.verify import compare


def _errors(*argv: str) -> list[str]:
    return [str(e) for e in precheck(list(argv))]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["launcher=local"],
            "parallel.strategy, launcher.nproc, launcher.nnodes: parallel=single keeps one copy of the model "
            "on one rank, but the job has 2 ranks",
        ),
        (["launcher=local", "parallel=ddp", "launcher.nproc=0"], "launcher.nproc: must be positive, got 0."),
        (
            ["launcher=local", "parallel=ddp", "launcher.max_restarts=2", "checkpoint.every=null"],
            "launcher.max_restarts, checkpoint.every: launcher.max_restarts=2 restarts a failed job",
        ),
        (
            ["launcher=inline", "launcher.max_restarts=1"],
            "launcher.max_restarts, launcher.backend: the inline backend",
        ),
        (["launcher=local", "parallel=ddp", "launcher.nnodes=2"], "needs launcher.rdzv_endpoint=HOST:PORT"),
        (
            ["launcher=local", "parallel=ddp", "launcher.nnodes=2", "launcher.rdzv_endpoint=h:1"],
            "run_dir: the 2 nodes of the job must be told one run directory",
        ),
        (
            ["launcher=local", "parallel=ddp", "launcher.nnodes=2", "launcher.node_rank=2", "run_dir=/tmp/x"],
            "launcher.node_rank=2 but the job has launcher.nnodes=2 nodes",
        ),
        (["launcher=local", "parallel=ddp", "launcher.node_rank=1"], "join a multi-node local job"),
        (
            ["launcher=local", "parallel=ddp", "launcher.nnodes=2", "verify_resume=true"],
            "verify_resume, launcher.nnodes: verify_resume=true starts runs of its own",
        ),
        (["launcher=local", "parallel=ddp", "launcher.timeout_s=0"], "launcher.timeout_s: must be positive"),
        (["launcher=local", "parallel=ddp", "launcher.master_port=70000"], "70000 is not a TCP port"),
        (["parallel=ddp", "parallel.comm_hook=bf16"], "the bf16 compression hook needs NCCL on CUDA GPUs"),
        (["parallel=ddp", "parallel.comm_hook=int4"], "unknown DDP communication hook 'int4'"),
        (
            ["parallel=ddp", "parallel.comm_hook=powersgd", "parallel.powersgd_start_iter=1"],
            "parallel.powersgd_start_iter: PowerSGD with error feedback can start at step 2",
        ),
        (
            ["parallel=ddp", "parallel.static_graph=true", "train.grad_accum_steps=2"],
            "parallel.static_graph, train.grad_accum_steps: DDP's static graph fails on accumulation",
        ),
        (["parallel=ddp", "parallel.bucket_mb=0"], "parallel.bucket_mb: must be positive"),
        (["verify_resume=true", "train.stop_after=5"], "verify_resume sets train.stop_after itself"),
        (
            ["verify_resume=true", "train.max_steps=1", "scheduler.warmup_steps=0"],
            "needs train.max_steps >= 2",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_bad_multiprocess_specs_are_refused_with_the_fix(argv: list[str], expected: str) -> None:
    errors = _errors(*argv)
    assert any(expected in e for e in errors), errors


def test_local_with_one_rank_and_ddp_on_one_rank_are_valid() -> None:
    assert _errors("launcher=local", "launcher.nproc=1") == []
    assert _errors("parallel=ddp") == []
    assert (
        _errors("launcher=local", "parallel=ddp", "parallel.comm_hook=powersgd", "launcher.max_restarts=1")
        == []
    )


def test_compare_names_the_first_differing_step_and_tolerance() -> None:
    a = {1: 5.0, 2: 4.0, 3: 3.0}
    assert compare(a, dict(a), 0.0).identical
    off = compare(a, {1: 5.0, 2: 4.0001, 3: 3.0}, 0.0)
    assert not off.identical and not off.within_tolerance and off.first_diff_step == 2
    assert "first differing step 2" in off.message and "max abs diff 0.0001" in off.message
    assert compare(a, {1: 5.0, 2: 4.0001, 3: 3.0}, 1e-3).within_tolerance
    assert "different steps" in compare(a, {1: 5.0}, 0.0).message

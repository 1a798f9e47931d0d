"""Rules of multi-process jobs, DDP options and verify_resume: each bad input named with its fix."""

from __future__ import annotations

import pytest

from launcher.components import hardware_facts
from launcher.front import cli
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


CUDA_PLAN = ["launcher.device=cuda", "launcher=local", "launcher.nproc=2", "parallel=ddp", "precision=bf16"]


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without a GPU, whatever it has."""
    monkeypatch.setattr("launcher.rules.hardware.cuda_facts", lambda: hardware_facts.NO_CUDA)


def test_a_gpu_run_is_planned_from_a_machine_without_one_for_the_gpu_it_names(
    no_gpu, capsys, tmp_path
) -> None:
    assert _errors(*CUDA_PLAN, "dry_run=true") == []  # no device count, no bf16 refusal: nothing starts here
    args = [*CUDA_PLAN, "dry_run=true", "simulate_hardware=h100_sxm", f"run_dir={tmp_path / 'run'}"]
    assert cli.run(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "verdict: valid" in out and "memory plan: per cuda device, 2 rank(s)" in out
    assert (
        "fit: fits: " in out
        and "of the 74.51 GiB of an NVIDIA H100 SXM 80GB (simulate_hardware=h100_sxm)" in out
    )
    assert "named, not probed: this machine has no GPU" in out
    big = ["model=gpt_1b", "data.seq_len=2048", "model.max_seq_len=2048", "train.micro_batch_size=16"]
    (error,) = _errors(*CUDA_PLAN, *big, "dry_run=true", "simulate_hardware=a100_80g")
    assert "exceeds the 74.51 GiB of NVIDIA A100 SXM 80GB (simulate_hardware=a100_80g)" in error
    assert "memory.activation_checkpointing=blocks: " in error
    fp8 = [*CUDA_PLAN, "precision=fp8", "dry_run=true"]
    assert _errors(*fp8, "simulate_hardware=h100_sxm") == []  # compute capability 9.0
    (error,) = _errors(*fp8, "simulate_hardware=a100_80g")
    assert "precision.fp8: fp8 matmuls need" in error and "compute capability 8.0" in error


def test_a_real_gpu_run_on_a_machine_without_one_is_refused_by_that_alone(no_gpu, tmp_path) -> None:
    (error,) = _errors(*CUDA_PLAN, "precision=fp8")  # no bf16, fp8 or device-count refusal besides
    assert error.startswith("launcher.device: launcher.device=cuda but no CUDA GPU is visible")
    assert "dry_run=true simulate_hardware=h100_sxm" in error
    assert cli.run([*CUDA_PLAN, f"run_dir={tmp_path / 'run'}"]) == 2 and not (tmp_path / "run").exists()

"""The resume rules across world sizes and strategies (launcher/rules/resume.py): what maps exactly is
accepted, the rest refused before launch with the keys and the fix (the runs: test_reshard.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.components import checkpoint
from launcher.front.cli import precheck
from launcher.parallel.checkpoint_layout import DCP_DIR, TAG

RESUME = ["resume=auto", "train.max_steps=200"]


def _errors(run_dir: Path, *argv: str) -> list[tuple[tuple[str, ...], str]]:
    return [(e.keys, e.message) for e in precheck([f"run_dir={run_dir}", *RESUME, *argv])]


def _fake_run(run_dir: Path, *, kind: str, ranks: int, micro: int = 4, **spec: dict) -> Path:
    """A run directory with one complete checkpoint of `kind` (dcp, files, deepspeed) and its spec.yaml."""

    def write(files) -> None:
        directory = files.directory
        if kind == "dcp":
            (directory / DCP_DIR).mkdir()
            (directory / DCP_DIR / ".metadata").write_bytes(b"x")
        elif kind == "deepspeed":
            (directory / TAG).mkdir()
            for rank in range(ranks):
                (directory / TAG / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x")
        else:
            (directory / "model.pt").write_bytes(b"x")
        for rank in range(ranks):
            (directory / f"rng_rank{rank}.pt").write_bytes(b"x")

    checkpoint.save(run_dir, 10, write, keep=1)
    written = {"train": {"micro_batch_size": micro, "grad_accum_steps": 1}, **spec}
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(written))
    return run_dir


def _ranks(n: int) -> list[str]:
    return ["launcher=local", f"launcher.nproc={n}"] if n > 1 else []


def test_dcp_and_files_checkpoints_resume_under_each_other_on_any_world_size(tmp_path: Path) -> None:
    """Same global batch (8 sequences per step): fsdp <-> single/ddp/tp, 2 -> 4 and 2 -> 1 ranks."""
    fsdp = _fake_run(tmp_path / "fsdp", kind="dcp", ranks=2, parallel={"strategy": "fsdp"})
    ddp = _fake_run(tmp_path / "ddp", kind="files", ranks=2, parallel={"strategy": "ddp"})
    for run in (fsdp, ddp):
        assert _errors(run, "parallel=fsdp", *_ranks(4), "train.micro_batch_size=2") == []
        assert _errors(run, "parallel=single", "train.micro_batch_size=8") == []
        assert _errors(run, "parallel=ddp", *_ranks(2), "train.micro_batch_size=4") == []
        assert _errors(run, "parallel=tp", *_ranks(2), "train.micro_batch_size=8") == []  # dp 1
        assert _errors(run, "parallel=fsdp", "train.micro_batch_size=4", "train.grad_accum_steps=2") == []


def test_another_global_batch_continues_the_position(tmp_path: Path) -> None:
    """Packed streams count their position in global sequences and test the epoch's end before every step."""
    run = _fake_run(tmp_path / "fsdp", kind="dcp", ranks=2, parallel={"strategy": "fsdp"})
    assert _errors(run, "parallel=fsdp", *_ranks(4)) == []  # 4 x 4: 16 sequences per step, was 8
    assert _errors(run, "parallel=fsdp", *_ranks(2), "train.grad_accum_steps=3") == []


def test_layouts_whose_position_has_no_exact_place_are_refused(tmp_path: Path) -> None:
    budget = _fake_run(tmp_path / "budget", kind="dcp", ranks=2, parallel={"strategy": "fsdp"})
    argv = ["data.packing=false", "data.batching=token_budget", "data.max_tokens_per_batch=128"]
    errors = _errors(budget, "parallel=fsdp", *argv, "train.micro_batch_size=8")
    assert any("token-budget batches" in message for _, message in errors), errors
    grouped = _fake_run(tmp_path / "grouped", kind="dcp", ranks=2, parallel={"strategy": "fsdp"})
    argv = ["data.packing=false", "data.batching=group_by_length"]
    errors = _errors(grouped, "parallel=fsdp", *argv, "train.micro_batch_size=4", "train.grad_accum_steps=2")
    assert any("length-grouped batches of 8 sequences" in message for _, message in errors), errors
    assert (
        _errors(grouped, "parallel=fsdp", *argv, "train.micro_batch_size=8") == []
    )  # 8 per global micro batch
    powersgd = _fake_run(tmp_path / "powersgd", kind="files", ranks=2, parallel={"strategy": "ddp"}, micro=2)
    errors = _errors(
        powersgd, "parallel=ddp", *_ranks(4), "train.micro_batch_size=1", "parallel.comm_hook=powersgd"
    )
    assert [keys for keys, _ in errors] == [("resume", "parallel.comm_hook", "launcher.nproc")]


def test_without_its_spec_yaml_a_checkpoint_resumes_only_on_its_world_size(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "fsdp", kind="dcp", ranks=2, parallel={"strategy": "fsdp"})
    (run / "spec.yaml").unlink()
    errors = _errors(run, "parallel=fsdp", "train.micro_batch_size=8")
    assert [keys for keys, _ in errors] == [("resume", "launcher.nproc")], errors
    assert _errors(run, "parallel=fsdp", *_ranks(2), "train.micro_batch_size=4") == []


def test_deepspeed_checkpoints_carry_their_weights_to_other_strategies_only(tmp_path: Path) -> None:
    ds = _fake_run(tmp_path / "ds", kind="deepspeed", ranks=2, parallel={"strategy": "deepspeed"})
    assert _errors(ds, "parallel=single", "train.micro_batch_size=8") == []
    assert _errors(ds, "parallel=fsdp", *_ranks(4), "train.micro_batch_size=2") == []
    other_world = _errors(ds, "parallel=zero2", *_ranks(4), "train.micro_batch_size=2")
    assert [keys for keys, _ in other_world] == [("resume", "launcher.nproc")]
    assert "launcher.nproc=2" in other_world[0][1] and "optimizer state" in other_world[0][1]
    adapters = _errors(ds, "parallel=single", "train.micro_batch_size=8", "quantization.lora.rank=4")
    assert [keys for keys, _ in adapters] == [("resume", "parallel.strategy", "quantization.lora.rank")]
    fsdp = _fake_run(tmp_path / "fsdp", kind="dcp", ranks=2, parallel={"strategy": "fsdp"})
    into_ds = _errors(fsdp, "parallel=zero2", *_ranks(2), "train.micro_batch_size=4")
    assert [keys for keys, _ in into_ds] == [("resume", "parallel.strategy")]
    assert "DeepSpeed resumes only its own checkpoints" in into_ds[0][1] and "train-export" in into_ds[0][1]


def test_a_rank_without_saved_rng_state_gets_the_derived_one(tmp_path: Path) -> None:
    """rng_rank{R}.pt where the checkpoint has it; otherwise a pure function of (seed, step, rank)."""
    import torch

    from launcher.rank.rng import restore_rng, rng_state

    torch.manual_seed(123)
    torch.save(rng_state(), tmp_path / "rng_rank0.pt")
    saved = torch.rand(3)

    def draws(rank: int, step: int = 4) -> torch.Tensor:
        torch.manual_seed(999)  # whatever state the process had before
        restore_rng(tmp_path, rank=rank, seed=7, step=step)
        return torch.rand(3)

    assert torch.equal(draws(0), saved)
    assert torch.equal(draws(2), draws(2))
    assert not torch.equal(draws(2), draws(3)) and not torch.equal(draws(2), draws(2, step=5))

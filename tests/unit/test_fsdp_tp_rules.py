"""Rules of the fsdp and tp strategies: each bad spec is refused before launch with its message."""

from __future__ import annotations

import pytest

from launcher.components import checkpoint
from launcher.front.cli import precheck

LOCAL2 = ["launcher=local", "launcher.nproc=2"]


def _messages(*argv: str) -> list[str]:
    return [str(e) for e in precheck(list(argv))]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["parallel=tp", *LOCAL2, "model.n_head=3", "model.d_model=192"],
            "must be multiples of parallel.tp_size",
        ),
        (["parallel=tp", *LOCAL2, "model.d_ff=129"], "the MLP width (129)"),
        (["parallel=tp", "launcher=local", "launcher.nproc=4"], "needs tp_size = world size >= 2"),
        (["parallel=tp"], "needs tp_size = world size >= 2"),
        (
            ["parallel=tp_fsdp", "launcher=local", "launcher.nproc=3"],
            "must be a multiple of parallel.tp_size",
        ),
        (
            ["parallel=fsdp_hybrid", *LOCAL2, "parallel.replicate_degree=4"],
            "must be a multiple of parallel.tp_size",
        ),
        (["parallel=fsdp", *LOCAL2, "parallel.sequence_parallel=true"], "needs parallel.tp_size >= 2"),
        (["parallel=tp", *LOCAL2, "parallel.sequence_parallel=true", "data.seq_len=33"], "data.seq_len (33)"),
        (
            ["parallel=ddp", *LOCAL2, "parallel.cpu_offload=true"],
            "configure FSDP2, but parallel.strategy=ddp",
        ),
        (["parallel=ddp", *LOCAL2, "parallel.tp_size=2"], "configure tensor parallelism"),
        (["parallel=fsdp", *LOCAL2, "parallel.zero_stage=2"], "ZeRO and FSDP are exclusive"),
        (["parallel=fsdp", *LOCAL2, "precision=fp16", "optimizer.implementation=fused"], "ShardedGradScaler"),
        (
            ["parallel=fsdp", *LOCAL2, "parallel.prefetch_layers=-1"],
            "parallel.prefetch_layers: must be 0 or more, got -1",
        ),
        (
            ["parallel=tp_fsdp", "launcher=local", "launcher.nproc=4", "quantization.lora.rank=8"],
            "tensor parallelism shards the q/k/v/o",
        ),
    ],
    ids=[
        "heads",
        "mlp-width",
        "tp-not-whole-world",
        "tp-one-rank",
        "world-vs-tp",
        "world-vs-replicas",
        "sequence-parallel-without-tp",
        "sequence-parallel-seq-len",
        "fsdp-key-with-ddp",
        "tp-key-with-ddp",
        "zero-with-fsdp",
        "fp16-fused",
        "prefetch",
        "lora-with-tp",
    ],
)
def test_bad_specs_are_refused_with_their_fix(argv: list[str], expected: str) -> None:
    messages = _messages(*argv)
    assert any(expected in m for m in messages), messages


def test_fsdp_on_one_rank_and_fp16_with_foreach_are_accepted() -> None:
    assert _messages("parallel=fsdp") == []
    assert _messages("parallel=fsdp", *LOCAL2, "precision=fp16") == []


def _fake_checkpoint(run_dir, *, sharded: bool, ranks: int) -> None:
    """A complete checkpoint directory with the files the resume rules look at."""

    def write(files) -> None:
        directory = files.directory
        if sharded:
            (directory / "dcp").mkdir()
            (directory / "dcp" / ".metadata").write_bytes(b"x")
        else:
            (directory / "model.pt").write_bytes(b"x")
        for rank in range(ranks):
            (directory / f"rng_rank{rank}.pt").write_bytes(b"x")

    checkpoint.save(run_dir, 10, write, keep=1)


def test_resume_across_strategies_and_world_sizes_is_accepted_where_it_maps(tmp_path) -> None:
    """More cases with a spec.yaml beside the checkpoint: tests/unit/test_resume_rules.py."""
    sharded, full = tmp_path / "sharded", tmp_path / "full"
    _fake_checkpoint(sharded, sharded=True, ranks=2)
    _fake_checkpoint(full, sharded=False, ranks=1)
    resume = ["resume=auto", "train.max_steps=200"]
    assert _messages(f"run_dir={full}", *resume, "parallel=fsdp") == []  # model.pt sharded at load
    grow = _messages(f"run_dir={sharded}", *resume, "parallel=fsdp", "launcher=local", "launcher.nproc=4")
    assert any("no spec.yaml beside it" in m for m in grow), grow  # its data layout is unknown
    assert _messages(f"run_dir={sharded}", *resume, "parallel=fsdp", *LOCAL2) == []  # same world size

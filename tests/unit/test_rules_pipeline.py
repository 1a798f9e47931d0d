"""Rules of the pp strategy: each bad pipeline spec is refused before launch with its keys and its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.components import checkpoint
from launcher.front.cli import precheck

PP2 = ["parallel.strategy=pp", "parallel.pp_size=2", "launcher=local", "launcher.nproc=2"]
PP4 = ["parallel.strategy=pp", "parallel.pp_size=4", "launcher=local", "launcher.nproc=4", "model.n_layer=8"]
INTERLEAVED = ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]


def _messages(*argv: str) -> list[str]:
    return [str(e) for e in precheck(list(argv))]


@pytest.mark.parametrize(
    ("argv", "keys", "phrase"),
    [
        (
            ["parallel=zero2", "parallel.pp_size=2"],
            "parallel.strategy, parallel.pp_size",
            "ZeRO-2/3 partition",
        ),
        (
            ["parallel=zero2", "parallel.pp_schedule=gpipe"],
            "parallel.pp_size, parallel.pp_schedule",
            "pp_size is 1",
        ),
        (
            ["parallel=fsdp", "parallel.pp_split=[2]"],
            "parallel.pp_split",
            "parallel.pp_size is 1 (no pipeline)",
        ),
        (["parallel=single", "parallel.pp_microbatches=8"], "parallel.pp_microbatches", "`parallel=pp`"),
        ([*PP2, "parallel.pp_schedule=zero"], "parallel.pp_schedule", "unknown pipeline schedule 'zero'"),
        (
            [*PP2, "model.n_layer=1"],
            "parallel.pp_size, parallel.pp_stages_per_rank, model.n_layer",
            "fewer than",
        ),
        ([*PP2, "parallel.pp_split=[0]"], "parallel.pp_split, parallel.pp_size", "parallel.pp_split=[2]"),
        ([*PP2, "parallel.pp_split=[1,2]"], "parallel.pp_split", "2 boundaries given, but 2 stages need 1"),
        ([*PP2, "parallel.pp_stages_per_rank=0"], "parallel.pp_stages_per_rank", "must be at least 1"),
        ([*PP2, "parallel.pp_stages_per_rank=2"], "parallel.pp_schedule", "places one stage on each rank"),
        ([*PP2, "parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_schedule", "it is plain 1f1b"),
        (
            [*PP2, "parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=3", "model.n_layer=6"],
            "parallel.pp_stages_per_rank, parallel.pp_schedule",
            "exactly two stages on each rank",
        ),
        ([*PP2, "parallel.pp_microbatches=0"], "parallel.pp_microbatches", "must be at least 1"),
        (
            [*PP4, "parallel.pp_microbatches=2"],
            "parallel.pp_microbatches, parallel.pp_size, parallel.pp_schedule",
            "Schedule1F1B refuses fewer micro batches than pipeline stages",
        ),
        (
            [*PP4, *INTERLEAVED, "parallel.pp_microbatches=6", "train.micro_batch_size=12"],
            "parallel.pp_microbatches, parallel.pp_size, parallel.pp_schedule",
            "must be a multiple of parallel.pp_size (4)",
        ),
        (
            [*PP2, "train.micro_batch_size=6"],
            "train.micro_batch_size, parallel.pp_microbatches",
            "Set train.micro_batch_size=8",
        ),
        (
            [*PP2, "data.batching=token_budget"],
            "data.batching, parallel.strategy",
            "token_budget batches vary",
        ),
        (
            [*PP2, "memory.auto_micro_batch=true"],
            "memory.auto_micro_batch, parallel.strategy",
            "not supported",
        ),
        (
            [*PP2, "parallel.tp_size=2", "launcher.nproc=4", "parallel.sequence_parallel=true"],
            "parallel.sequence_parallel, parallel.strategy",
            "not supported under a pipeline yet",
        ),
        (
            [*PP2, "quantization.method=int8"],
            "quantization.method, parallel.strategy",
            "use `parallel=fsdp`",
        ),
        (
            [*PP2, "quantization.lora.rank=8"],
            "quantization.lora.rank, parallel.strategy",
            "use `parallel=fsdp`",
        ),
        ([*PP2, "parallel.pp_size=1"], "parallel.strategy, parallel.pp_size", "needs pp_size >= 2"),
        ([*PP2, "launcher.nproc=3"], "parallel.pp_size", "must be a multiple of"),
        (
            [*PP2, "launcher.nproc=4", "parallel.tp_size=2", "model.n_head=3", "model.d_model=192"],
            "parallel.tp_size, model.n_head",
            "must be multiples of parallel.tp_size",
        ),
    ],
    ids=[
        "pp-size-with-deepspeed",
        "pp-key-with-deepspeed",
        "pp-key-with-fsdp",
        "pp-key-with-single",
        "unknown-schedule",
        "fewer-layers-than-stages",
        "split-not-rising",
        "split-too-long",
        "stages-per-rank-zero",
        "1f1b-multi-stage",
        "interleaved-single-stage",
        "zero-bubble-not-two",
        "microbatches-zero",
        "1f1b-fewer-microbatches-than-stages",
        "interleaved-not-whole-rounds",
        "batch-not-divisible",
        "token-budget",
        "auto-micro-batch",
        "sequence-parallel",
        "quantized",
        "adapters",
        "pp-size-one",
        "world-vs-pp",
        "tp-heads-inside-stage",
    ],
)
def test_bad_pipeline_specs_are_refused_with_their_fix(argv: list[str], keys: str, phrase: str) -> None:
    messages = _messages(*argv)
    assert any(keys in m.split(": ", 1)[0] and phrase in m for m in messages), messages


@pytest.mark.parametrize(
    "argv",
    [
        PP2,
        [
            *PP2,
            "launcher.nproc=8",
            "parallel.tp_size=2",
            "parallel.replicate_degree=2",
            "parallel.cpu_offload=true",
        ],
        [*PP2, "parallel.reshard_after_forward=false", "parallel.prefetch_layers=2"],
        [*PP4, "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1", "train.micro_batch_size=4"],
        [*PP4, *INTERLEAVED, "parallel.pp_microbatches=8"],
        [
            *PP4,
            "parallel.pp_schedule=zero_bubble",
            "parallel.pp_stages_per_rank=2",
            "parallel.pp_microbatches=1",
        ],
        [*PP2, "model.n_layer=6", "parallel.pp_split=[2]"],
        ["parallel=fsdp", "parallel.pp_size=2", "launcher=local", "launcher.nproc=4"],
        ["parallel=ddp", "parallel.pp_size=2", "launcher=local", "launcher.nproc=4"],
        ["parallel=single", "parallel.pp_size=2", "launcher=local", "launcher.nproc=2"],
    ],
    ids=[
        "plain",
        "fsdp-and-tp-keys",
        "fsdp-keys",
        "gpipe-one-microbatch",
        "interleaved",
        "zero-bubble",
        "split",
        "fsdp-axis",
        "ddp-axis",
        "single-axis",
    ],
)
def test_good_pipeline_specs_are_accepted(argv: list[str]) -> None:
    assert _messages(*argv) == []


def _fake_run(run_dir: Path, *, strategy: str | None, sharded: bool, ranks: int) -> None:
    """A run directory with one complete checkpoint and, unless `strategy` is None, the spec.yaml naming it."""

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
    if strategy is not None:
        pp_size = 2 if strategy == "pp" else 1
        (run_dir / "spec.yaml").write_text(
            f"parallel:\n  strategy: {strategy}\n  pp_size: {pp_size}\ntrain:\n  micro_batch_size: 16\n"
        )


def test_checkpoints_cross_between_pp_and_other_strategies_only_through_export(tmp_path: Path) -> None:
    by_pp, by_fsdp, by_ddp = tmp_path / "pp", tmp_path / "fsdp", tmp_path / "ddp"
    _fake_run(by_pp, strategy="pp", sharded=True, ranks=2)
    _fake_run(by_fsdp, strategy="fsdp", sharded=True, ranks=2)
    _fake_run(by_ddp, strategy=None, sharded=False, ranks=2)
    resume = ["resume=auto", "train.max_steps=200", "launcher=local", "launcher.nproc=2"]

    into_fsdp = _messages(f"run_dir={by_pp}", *resume, "parallel=fsdp")
    assert any(
        m.startswith("resume, parallel.strategy:") and "written by strategy pp" in m and "train-export" in m
        for m in into_fsdp
    ), into_fsdp
    from_fsdp = _messages(f"run_dir={by_fsdp}", *resume, *PP2)
    assert any("written by strategy fsdp" in m and "new run from them" in m for m in from_fsdp), from_fsdp
    from_ddp = _messages(f"run_dir={by_ddp}", *resume, *PP2)
    assert any("single, ddp or deepspeed" in m for m in from_ddp), from_ddp

    assert _messages(f"run_dir={by_pp}", *resume, *PP2, "parallel.pp_schedule=gpipe") == []
    grow = _messages(f"run_dir={by_pp}", *resume, *PP2, "launcher.nproc=4")  # 2 data-parallel ranks of 16
    assert grow == [], grow  # another global batch continues the epoch where the checkpoint stopped
    assert _messages(f"run_dir={by_pp}", *resume, *PP2, "launcher.nproc=4", "train.micro_batch_size=8") == []
    assert _messages(f"run_dir={by_fsdp}", *resume, "parallel=fsdp") == []  # fsdp -> fsdp unchanged


def test_interleaved_fix_changes_the_micro_batch_when_no_multiple_divides_it() -> None:
    """pp_size 3, micro batch 16: no multiple of 3 divides 16, so the fix names both keys, never 9."""
    argv = [
        "parallel.strategy=pp", "parallel.pp_size=3", "launcher=local", "launcher.nproc=3", "model.n_layer=6",
        *INTERLEAVED, "train.micro_batch_size=16", "parallel.pp_microbatches=8",
    ]  # fmt: skip
    [message] = [m for m in _messages(*argv) if "whole rounds" in m]
    assert "train.micro_batch_size=48 parallel.pp_microbatches=3" in message and "=9" not in message

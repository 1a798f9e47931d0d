"""Context parallel without processes: the load-balanced split and merge, the refusals, the planner's terms."""

from __future__ import annotations

import pytest
import torch

from launcher.components.model.context_parallel import merge_sequence, shard_batch, shard_sequence
from launcher.front.cli import precheck

TWO = ["launcher=local", "launcher.nproc=2"]
FOUR = ["launcher=local", "launcher.nproc=4"]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_merges_back_and_balances_causal_work(size: int) -> None:
    seq = torch.arange(2 * 16).reshape(2, 16)
    parts = [shard_sequence(seq, rank, size) for rank in range(size)]
    assert torch.equal(merge_sequence(torch.cat(parts, dim=1), size), seq)
    # rank r holds chunks r and 2N-1-r: every rank's queries see the same number of keys in all
    work = {int((part[0] + 1).sum()) for part in parts}
    assert len(work) == 1, work
    if size == 2:
        assert parts[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert parts[1][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_shard_batch_pads_unpacked_rows_with_untrained_tokens() -> None:
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "labels": torch.ones(2, 6, dtype=torch.long)}
    parts = [shard_batch(batch, rank, 2) for rank in range(2)]
    labels = merge_sequence(torch.cat([p["labels"] for p in parts], dim=1), 2)
    assert labels.shape == (2, 8) and labels[:, 6:].eq(-100).all() and labels[:, :6].eq(1).all()


@pytest.mark.parametrize(
    ("argv", "keys", "phrase"),
    [
        (
            [*TWO, "parallel.cp_size=2", "data.seq_len=30"],
            ("parallel.cp_size", "data.seq_len"),
            "data.seq_len=28",
        ),
        (
            [*TWO, "parallel=ddp", "parallel.cp_size=3", "data.seq_len=36"],
            ("parallel.cp_size",),
            "multiple of",
        ),
        (
            [*TWO, "parallel=zero2", "parallel.cp_size=2"],
            ("parallel.cp_size", "parallel.strategy"),
            "DeepSpeed",
        ),
        (
            [*FOUR, "parallel=fsdp", "parallel.pp_size=2", "parallel.cp_size=2"],
            ("parallel.cp_size", "parallel.pp_size"),
            "pipeline",
        ),
        (
            [*FOUR, "parallel=fsdp", "parallel.tp_size=2", "parallel.cp_size=2"],
            ("parallel.cp_size", "parallel.tp_size"),
            "not built yet",
        ),
        (
            [*TWO, "parallel.cp_size=2", "model=hf_llama_tiny"],
            ("parallel.cp_size", "model.kind"),
            "Hugging Face",
        ),
        (
            [*TWO, "parallel.cp_size=2", "model.attention=flex"],
            ("parallel.cp_size", "model.attention"),
            "flex",
        ),
    ],
    ids=["seq_len", "world", "deepspeed", "pipeline", "tensor_parallel", "hf_model", "flex"],
)
def test_context_parallel_refusals_name_the_key(argv: list[str], keys: tuple[str, ...], phrase: str) -> None:
    errors = {e.keys[: len(keys)]: e.message for e in precheck(argv) if "parallel.cp_size" in e.keys}
    assert keys in errors, errors
    assert phrase in errors[keys]


def test_refused_on_the_command_line_with_exit_2(tmp_path) -> None:
    from conftest import TINY, run_cli

    result = run_cli([*TINY, *TWO, "parallel.cp_size=2", "data.seq_len=30"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "parallel.cp_size" in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()


def _plan(*argv: str) -> tuple[float, object]:
    """The budget memory.max_memory_gb sets each rank (bytes), and the plan of a 125M GPT at 16k tokens."""
    from launcher.front.compose import compose, strip_hydra
    from launcher.plan.planner import plan
    from launcher.spec import to_spec

    base = ["model=gpt_125m", "data.seq_len=16384", "model.max_seq_len=16384", "train.micro_batch_size=1"]
    spec = to_spec(strip_hydra(compose([*base, *TWO, "memory=auto_batch", "memory.max_memory_gb=10", *argv])))
    return spec.memory.max_memory_gb * 2**30, plan(spec, device_type="cpu")


def test_planner_divides_activations_by_cp_and_fits_a_budget_one_rank_does_not() -> None:
    """16k tokens of the 125M GPT under memory.max_memory_gb=10: two cp ranks fit, a rank holding it whole does not."""
    budget, one = _plan("parallel=ddp")  # each rank holds whole sequences
    _, two = _plan("parallel=ddp", "parallel.cp_size=2")
    assert 0.45 < two.activations / one.activations < 0.6  # halved, plus the gathered keys/values and masks
    assert one.total > budget >= two.total, (one.total / 2**30, two.total / 2**30)
    assert any("context parallel" in note for note in two.notes)

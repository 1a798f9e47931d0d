"""LoRA (peft) on real ranks (gloo, 2 processes) under DeepSpeed ZeRO-2 and ZeRO-3, and FSDP2 where the
rules allow it: loss parity with one process, exact resume from an adapter-only checkpoint, and its
offline consolidation (the base rebuilt from the spec, the adapters loaded into it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY, losses, run_inline, run_ranks
from launcher.front import merge
from launcher.front.cli import precheck
from launcher.groups import checkpoint
from launcher.parallel.deepspeed import module_states_file
from launcher.parallel.dtensor import saved_model_keys

TWO_RANKS = ["launcher=local", "launcher.nproc=2"]
LORA = [*TINY, "quantization=lora", "train.eval_every=null", "train.max_steps=8", "checkpoint.every=4"]
OPTIONS = ["zero2", "zero3", "fsdp"]
_runs: dict[str, Path] = {}


def _allowed(option: str) -> None:
    """Skip where the rules refuse LoRA under this strategy (FSDP2: launcher.rules.sharding decides)."""
    errors = precheck([*LORA, *TWO_RANKS, f"parallel={option}"])
    if errors:
        pytest.skip(f"refused before launch: {errors[0].message}")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 2-rank run of a strategy (shared by parity and resume)."""

    def run(option: str) -> Path:
        if option not in _runs:
            run_dir = tmp_path_factory.mktemp(option) / "run"
            proc = run_ranks([*LORA, *TWO_RANKS, f"parallel={option}"], run_dir, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            _runs[option] = run_dir
        return _runs[option]

    return run


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One process with the 2-rank job's global batch (micro batch 8 = 2 ranks x 4)."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert run_inline([*LORA, "train.micro_batch_size=8"], run_dir) == 0
    return run_dir


@pytest.mark.parametrize("option", OPTIONS)
def test_lora_losses_match_one_process(straight, one_process, option: str) -> None:
    _allowed(option)
    got, want = losses(straight(option)), losses(one_process)
    assert got.keys() == want.keys()
    for step in want:  # fp32, same init and data: equal up to summation order (measured < 2e-7)
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])


@pytest.mark.parametrize("option", OPTIONS)
def test_lora_resume_is_exact_from_adapters_alone(straight, tmp_path, option: str) -> None:
    _allowed(option)
    split = tmp_path / "split"
    first = run_ranks([*LORA, *TWO_RANKS, f"parallel={option}", "train.stop_after=4"], split, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    step_dir = checkpoint.good_checkpoints(split)[0]
    _, model = merge.load_adapted(step_dir)  # offline: base rebuilt, consolidated adapters loaded (checked)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if option == "fsdp":
        saved = saved_model_keys(step_dir)
    else:
        saved = set(
            torch.load(module_states_file(step_dir), map_location="cpu", weights_only=False)["module"]
        )
    assert saved == trainable  # no frozen key, not even the output head tied to the embedding
    second = run_ranks([*LORA, *TWO_RANKS, f"parallel={option}", "resume=auto"], split, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    assert losses(split) == losses(straight(option))  # bitwise, step by step

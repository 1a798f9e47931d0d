"""LoRA (peft) on real ranks (gloo, 2 processes) under DeepSpeed ZeRO-2 and ZeRO-3 and FSDP2, and QLoRA
under FSDP2 (torchao's NF4 base sharded with the adapters): loss parity with one process, exact resume
from an adapter-only checkpoint, and its offline consolidation (the base rebuilt from the spec, the
adapters loaded into it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY, losses, run_inline, run_ranks
from launcher.components import checkpoint
from launcher.parallel.deepspeed import module_states_file
from launcher.parallel.part_state import saved_model_keys
from launcher.tools import merge

TWO_RANKS = ["launcher=local", "launcher.nproc=2"]
LORA = [*TINY, "quantization=lora", "train.eval_every=null", "train.max_steps=8", "checkpoint.every=4"]
# QLoRA: NF4 needs block matrices of whole 16384-weight groups per shard (d_model 256); no adapter
# dropout, whose masks differ between one process and two ranks.
QLORA = ["quantization=nf4_lora", "quantization.lora.dropout=0", "model.d_model=256", "model.n_head=4"]
OPTIONS = {
    "zero2": ["parallel=zero2"],
    "zero3": ["parallel=zero3"],
    "fsdp": ["parallel=fsdp"],
    "fsdp-qlora": ["parallel=fsdp", *QLORA],
}
# The one-process reference of each option: the same model and adapters (torchao's NF4 for QLoRA, which
# `nf4_backend=auto` picks under FSDP2).
REFERENCE = {"fsdp-qlora": [*QLORA, "quantization.nf4_backend=torchao"]}
_runs: dict[str, Path] = {}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 2-rank run of a strategy (shared by parity and resume)."""

    def run(option: str) -> Path:
        if option not in _runs:
            run_dir = tmp_path_factory.mktemp(option) / "run"
            proc = run_ranks([*LORA, *TWO_RANKS, *OPTIONS[option]], run_dir, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            _runs[option] = run_dir
        return _runs[option]

    return run


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process with the 2-rank job's global batch (micro batch 8 = 2 ranks x 4), per reference."""

    def run(option: str) -> Path:
        key = f"one:{' '.join(REFERENCE.get(option, []))}"
        if key not in _runs:
            run_dir = tmp_path_factory.mktemp("one") / "run"
            assert run_inline([*LORA, *REFERENCE.get(option, []), "train.micro_batch_size=8"], run_dir) == 0
            _runs[key] = run_dir
        return _runs[key]

    return run


# zero2 and plain fsdp in the extended tier: zero3 holds LoRA's parity through DeepSpeed's partitioned engine
# (zero2 partitions less of the same state), fsdp-qlora through FSDP2 (plain LoRA on fsdp is that run without
# the 4-bit base).
@pytest.mark.parametrize(
    "option", [pytest.param(o, marks=pytest.mark.extended) if o in ("zero2", "fsdp") else o for o in OPTIONS]
)
def test_lora_losses_match_one_process(straight, one_process, option: str) -> None:
    got, want = losses(straight(option)), losses(one_process(option))
    assert got.keys() == want.keys()
    for step in want:  # fp32, same init and data: equal up to summation order (measured < 2e-7)
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])


# Only ZeRO-3 in the default tier: it proves the adapter-only checkpoint; FSDP2's adapter-only DCP checkpoint
# with an NF4 base resumes bitwise in test_preference_qlora_fsdp.py (QLoRA DPO on FSDP2).
RESUMED = [
    pytest.param("zero2", marks=pytest.mark.extended),
    "zero3",
    pytest.param("fsdp", marks=pytest.mark.extended),
    pytest.param("fsdp-qlora", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("option", RESUMED)
def test_lora_resume_is_exact_from_adapters_alone(straight, tmp_path, option: str) -> None:
    """The straight run's step-4 checkpoint holds the adapters alone; a new run resumed from it gives
    steps 5-8 bitwise (the straight run is shared with the parity test: one launch less per option)."""
    step_dir = straight(option) / "checkpoints" / "step_4"
    _, model = merge.load_adapted(step_dir)  # offline: base rebuilt, consolidated adapters loaded (checked)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if option.startswith("fsdp"):
        saved = saved_model_keys(step_dir)
    else:
        saved = set(
            torch.load(module_states_file(step_dir), map_location="cpu", weights_only=False)["module"]
        )
    assert saved == trainable  # no frozen key, not even the output head tied to the embedding
    resumed = tmp_path / "resumed"
    second = run_ranks([*LORA, *TWO_RANKS, *OPTIONS[option], f"resume={step_dir}"], resumed, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    want = {step: loss for step, loss in losses(straight(option)).items() if step > 4}
    assert losses(resumed) == want and set(want) == {5, 6, 7, 8}  # bitwise, step by step


def test_qlora_from_fsdp2_exports_merged_and_as_adapters(straight, tmp_path) -> None:
    """The sharded QLoRA run leaves as a Hugging Face folder (adapters folded into the dequantized NF4
    base) with the adapted model's logits, or as a PEFT adapter folder."""
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM

    from launcher.tools import export

    run_dir = straight("fsdp-qlora")
    assert export.main([str(run_dir), str(tmp_path / "hf"), "--format", "hf", "--merge"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _, adapted = merge.load_adapted(checkpoint.good_checkpoints(run_dir)[0])
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, adapted(tokens), rtol=1e-5, atol=1e-5)
    assert export.main([str(run_dir), str(tmp_path / "peft"), "--adapter"]) == 0
    config = PeftConfig.from_pretrained(str(tmp_path / "peft"))
    assert config.r == 16 and (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    assert export.main([str(run_dir), str(tmp_path / "both"), "--adapter", "--merge"]) == 2

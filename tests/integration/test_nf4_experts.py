"""QLoRA on Mixture-of-Experts models: the frozen routed experts stored as torchao NF4 tensors, sharded by FSDP2.

A tiny Qwen3-MoE folder (config.json as the real one, 2 layers, hidden 256 so that every matrix and each
layer's stacked experts hold whole 16384-weight NF4 groups per shard; random weights saved with
`save_pretrained`): `quantization=nf4_lora parallel=fsdp` on 2 ranks trains with the experts NF4 on each rank
(its param_bytes), and the merged export gives the adapted model's logits. In one process the experts are
NF4Tensors whose dequantized forward is the model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY, losses, run_ranks, write_spec
from launcher.components.metrics import read_metrics
from launcher.spec import InvalidSpec, load_spec

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")

QLORA = ["quantization=nf4_lora", "quantization.lora.dropout=0"]
BASE = [*TINY, "train.eval_every=null", "train.max_steps=4", "checkpoint.every=4"]
RUN = [*BASE, "model=hf", *QLORA]
NF4_WEIGHTS = 2 * (256 * 256 * 2 + 128 * 256 * 2) + 2 * (4 * 128 * 256 + 4 * 256 * 64)
"""Weights stored as NF4: 2 layers of q/o [256, 256] and k/v [128, 256], and of the experts' gate_up_proj
[4, 128, 256] and down_proj [4, 256, 64]; the other 192,000 parameters (embedding, norms, routers, adapters)
stay float32."""
NF4_BYTES_PER_WEIGHT = 1 / 2 + 1 / 64 + 4 / 16384
"""A 4-bit code, an 8-bit scale per 64 weights and a float32 factor per 16384."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE folder whose matrices are whole NF4 groups on 2 shards (4 experts, 2 per token)."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=96, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, vocab_size=256, use_cache=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(1234)
    out = tmp_path_factory.mktemp("qwen3_moe_nf4") / "model"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.extended  # the FSDP2 test below checks the rebuilt experts' type and the merged export's logits
def test_experts_are_nf4_and_their_forward_is_the_dequantized_model(folder, tmp_path) -> None:
    """One process, torchao's store: every fused expert tensor is an NF4Tensor; the model's logits are those of
    the same model holding the dequantized experts (the merged state dict, 3-D again)."""
    from launcher.components import quantization
    from launcher.components.model.build import build_model

    spec = load_spec(write_spec([*RUN, f"model.path={folder}", "quantization.nf4_backend=torchao"], tmp_path))
    model = quantization.apply(build_model(spec.model), spec.quantization, torch.float32).eval()
    experts = {n: type(p).__name__ for n, p in model.named_parameters() if ".experts." in n}
    assert len(experts) == 4 and set(experts.values()) == {"NF4Tensor"}, experts
    merged = quantization.merged_state_dict(model)
    assert merged["hf.model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 256)
    plain = build_model(spec.model).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), plain(_ids()), rtol=1e-5, atol=1e-5)


def test_fsdp2_trains_nf4_experts_and_exports_the_adapted_logits(folder, tmp_path) -> None:
    """2 ranks: the loss falls, each rank stores its half of the experts as NF4 (about 4.1 bits per weight,
    not 32), and `train-export --format hf --merge` gives the adapted model's logits (1e-5)."""
    from launcher.components import checkpoint
    from launcher.tools import export
    from launcher.tools.merge import load_adapted

    run_dir = tmp_path / "run"
    proc = run_ranks(
        [*RUN, f"model.path={folder}", "parallel=fsdp", "launcher=local", "launcher.nproc=2"],
        run_dir,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    loss = losses(run_dir)
    assert loss.keys() == {1, 2, 3, 4} and loss[4] < loss[1] - 0.1, loss
    stored = read_metrics(run_dir / "metrics.jsonl")[-1]["param_bytes"]  # this rank's half
    assert stored == pytest.approx((192_000 * 4 + NF4_WEIGHTS * NF4_BYTES_PER_WEIGHT) / 2, rel=0.01)
    out = tmp_path / "merged"
    assert export.main([str(run_dir), str(out), "--format", "hf", "--merge"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    _, adapted = load_adapted(checkpoint.good_checkpoints(run_dir)[0])
    assert {type(p).__name__ for n, p in adapted.named_parameters() if ".experts." in n} == {"NF4Tensor"}
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=_ids()).logits, adapted.eval()(_ids()), rtol=1e-5, atol=1e-5
        )


def test_experts_that_do_not_split_into_nf4_groups_or_into_ep_slices_are_refused(folder, tmp_path) -> None:
    small = [*TINY, "model=gpt_moe_tiny", "model.d_model=256", "model.n_head=4", *QLORA, "parallel=fsdp"]
    with pytest.raises(
        InvalidSpec
    ) as caught:  # w_up [8, 256, 8]: 16384 weights, not whole groups on 2 shards
        write_spec([*small, "model.moe.d_ff=8", "launcher=local", "launcher.nproc=2"], tmp_path / "a")
    assert "w_up [8, 256, 8]" in str(caught.value) and "quantization.method" in str(caught.value)
    with pytest.raises(InvalidSpec) as caught:
        write_spec([*small, "parallel.ep_size=2", "launcher=local", "launcher.nproc=2"], tmp_path / "b")
    assert "parallel.ep_size=1" in str(caught.value)


@pytest.mark.extended  # the same store on the built-in GPT's w_up / w_down; the Qwen3-MoE run above proves it
def test_the_builtin_moe_gpt_trains_with_nf4_experts_under_fsdp2(tmp_path) -> None:
    """w_up [8, 256, 64] and w_down [8, 64, 256] of 2 MoE blocks NF4 on 2 ranks, routers in full precision."""
    gpt = [
        "model=gpt_moe_tiny",
        "model.n_layer=2",
        "model.d_model=256",
        "model.n_head=4",
        "model.moe.d_ff=64",
    ]
    run_dir = tmp_path / "run"
    args = [*BASE, *QLORA, *gpt, "parallel=fsdp", "launcher=local", "launcher.nproc=2"]
    proc = run_ranks(args, run_dir, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loss = losses(run_dir)
    assert loss.keys() == {1, 2, 3, 4} and loss[4] < loss[1] - 0.1, loss
    experts = 2 * 2 * 8 * 256 * 64  # stored as NF4: the experts and the attention's 2 x 4 [256, 256] matrices
    nf4_weights, fp32_params = experts + 2 * 4 * 256 * 256, 1_259_008 - experts - 2 * 4 * 256 * 256
    stored = read_metrics(run_dir / "metrics.jsonl")[-1]["param_bytes"]
    assert stored == pytest.approx((fp32_params * 4 + nf4_weights * NF4_BYTES_PER_WEIGHT) / 2, rel=0.01)

"""The memory planner's formulas: ZeRO and FSDP sharding, optimizer states, LoRA and quantized sizes."""

from __future__ import annotations

import pytest
from rich.console import Console

from launcher.components.model.build import build_model, num_params
from launcher.config.model import ModelConfig
from launcher.front import compose, dryrun
from launcher.plan import planner
from launcher.plan import states as model_states
from launcher.plan.activations import ActivationShape, activation_bytes
from launcher.spec import RunSpec, to_spec


def make_spec(overrides: list[str]) -> RunSpec:
    """The spec `train` would build from these overrides (not validated against this machine)."""
    return to_spec(compose.strip_hydra(compose.compose(overrides)))


@pytest.mark.parametrize("shape", [{}, {"d_ff": 96, "tie_embeddings": False, "bias": True}])
def test_parameter_count_matches_the_built_model(shape: dict) -> None:
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=2, **shape)
    spec = RunSpec(model=cfg)
    assert model_states.count_params(spec).total == num_params(build_model(cfg))


LLAMA_2_7B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}  # fmt: skip


def test_hugging_face_models_are_counted_from_their_config(tmp_path) -> None:
    """Llama-2-7B's config alone (no weights): its published 6,738,415,616 parameters, and a plan."""
    import json

    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    cfg = ModelConfig(kind="hf", hf_config=str(tmp_path), vocab_size=32000)
    spec = RunSpec(model=cfg)
    counts = model_states.count_params(spec)
    assert counts.total == 6_738_415_616
    assert counts.block_linear == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    memory = planner.plan(spec, world=8)
    assert memory.num_params == counts.total and memory.parameters == 4 * counts.total  # single: whole fp32
    resized = RunSpec(
        model=ModelConfig(kind="hf", hf_config=str(tmp_path), vocab_size=32064, resize_embeddings=True)
    )
    assert (
        model_states.count_params(resized).total == counts.total + 2 * 64 * 4096
    )  # embedding and untied head grow


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_shard_as_the_paper_says(stage: int) -> None:
    world = 8
    spec = make_spec(["model=gpt_125m", "precision=bf16", f"parallel=zero{stage}"])
    psi = model_states.count_params(spec).total
    plan = planner.plan(spec, world, "cpu")
    weights, grads, states = {
        0: (2 * psi, 2 * psi, 12 * psi),
        1: (2 * psi, 2 * psi, 12 * psi / world),  # 4Ψ + 12Ψ/N
        2: (2 * psi, 2 * psi / world, 12 * psi / world),  # 2Ψ + 14Ψ/N
        3: (2 * psi / world, 2 * psi / world, 12 * psi / world),  # 16Ψ/N
    }[stage]
    assert plan.parameters == pytest.approx(weights, rel=1e-6)
    assert plan.gradients == pytest.approx(grads, rel=1e-6)
    assert plan.optimizer_states == pytest.approx(states, rel=1e-6)


def test_zero_offload_moves_states_to_the_host() -> None:
    spec = make_spec(["model=gpt_125m", "precision=bf16", "parallel=zero3_offload"])
    plan = planner.plan(spec, 4, "cpu")
    assert plan.parameters == plan.optimizer_states == 0
    assert plan.host_bytes == pytest.approx(14 * model_states.count_params(spec).total / 4, rel=1e-6)


def test_fsdp_full_shard_divides_everything_and_shard_grad_op_keeps_weights() -> None:
    psi = model_states.count_params(make_spec(["model=gpt_125m"])).total
    full = planner.plan(make_spec(["model=gpt_125m", "parallel=fsdp"]), 8, "cpu")
    assert (full.parameters, full.gradients, full.optimizer_states) == pytest.approx(
        (4 * psi / 8, 4 * psi / 8, 8 * psi / 8), rel=1e-6
    )
    grad_op = planner.plan(make_spec(["model=gpt_125m", "parallel=fsdp_shard_grad_op"]), 8, "cpu")
    assert grad_op.parameters > 4 * psi and grad_op.gradients == full.gradients


def test_single_and_ddp_hold_full_float32_states() -> None:
    psi = model_states.count_params(make_spec([])).total
    for overrides in ([], ["parallel=ddp", "launcher=local"]):
        plan = planner.plan(make_spec(overrides), 2, "cpu")
        assert (plan.parameters, plan.gradients, plan.optimizer_states) == (4 * psi, 4 * psi, 8 * psi)


@pytest.mark.parametrize(
    ("optimizer", "per_param"), [("sgd", 4.0), ("adamw_8bit", 2.03), ("lion_8bit", 1.02), ("adamw", 8.0)]
)
def test_optimizer_state_bytes(optimizer: str, per_param: float) -> None:
    spec = make_spec([f"optimizer={optimizer}"])
    plan = planner.plan(spec, 1, "cpu")
    assert plan.optimizer_states / model_states.count_params(spec).total == pytest.approx(per_param, abs=0.01)


def test_lora_trains_only_the_adapters() -> None:
    spec = make_spec(["model=gpt_125m", "quantization=lora", "quantization.lora.rank=8"])
    counts = model_states.count_params(spec)
    d, ff = 768, 4 * 768
    assert counts.adapters == 12 * 8 * (4 * (d + d) + (d + ff) + (ff + d))
    plan = planner.plan(spec, 1, "cpu")
    assert plan.gradients == 4 * counts.adapters and plan.optimizer_states == 8 * counts.adapters
    only_qv = make_spec(["model=gpt_125m", "quantization=lora", "quantization.lora.targets=[q_proj,v_proj]"])
    assert model_states.count_params(only_qv).adapters == 12 * 16 * 2 * (d + d)


@pytest.mark.parametrize(("method", "per_weight"), [("nf4", 0.5159), ("int8", 1.005)])
def test_quantized_weights_take_their_bits(method: str, per_weight: float) -> None:
    spec = make_spec(["model=gpt_125m", f"quantization={method}_lora"])
    counts = model_states.count_params(spec)
    plan = planner.plan(spec, 1, "cpu")
    rest = 4 * (counts.total - counts.block_linear) + 4 * counts.adapters  # embeddings, norms, adapters
    assert (plan.parameters - rest) / counts.block_linear == pytest.approx(per_weight, abs=1e-3)


def test_checkpointing_and_tensor_parallel_shrink_activations() -> None:
    cfg = ModelConfig(n_layer=12, n_head=12, d_model=768, vocab_size=256, max_seq_len=1024)  # logits small
    shape = ActivationShape(micro_batch=8, seq_len=1024, act_bytes=2)
    full = activation_bytes(cfg, shape)
    assert activation_bytes(cfg, shape, mode="attention") < full
    assert activation_bytes(cfg, shape, mode="blocks") < activation_bytes(
        cfg, shape, mode="blocks", checkpoint_every=2
    )
    assert activation_bytes(cfg, shape, mode="blocks") < full / 2
    tp = ActivationShape(micro_batch=8, seq_len=1024, act_bytes=2, tp_size=2)
    assert activation_bytes(cfg, tp) < full


def test_cuda_plans_count_context_and_offloaded_activations() -> None:
    spec = make_spec(["model=gpt_125m", "precision=bf16"])
    on_gpu, on_cpu = planner.plan(spec, 1, "cuda"), planner.plan(spec, 1, "cpu")
    assert on_gpu.buffers >= on_cpu.buffers + planner.CUDA_CONTEXT_BYTES
    offloaded = planner.plan(make_spec(["model=gpt_125m", "precision=bf16", "memory=offload"]), 1, "cuda")
    assert offloaded.activations < on_gpu.activations and offloaded.host_bytes > 0


def test_plan_prints_as_a_table() -> None:
    console = Console(record=True, width=120)
    spec, _ = compose.validate(compose.compose(["model=gpt_125m", "parallel=zero2", "precision=bf16"]))
    dryrun.print_plan(console, spec)
    text = console.export_text()
    for part in ("parameters", "gradients", "optimizer states", "activations", "buffers", "total"):
        assert part in text
    assert "2Ψ + 14Ψ/N" in text and "124.37M parameters" in text

"""Tiny Hugging Face Mixture-of-Experts folders: configs shaped as the real ones, fewer layers, smaller widths.

`save_pretrained` of transformers 5 writes the experts as per-expert tensors (Mixtral's
`block_sparse_moe.experts.N.w1/w2/w3`, the Qwen families' `mlp.experts.N.gate_proj/up_proj/down_proj`),
reverting the fused tensors it trains with; `layout="fused"` writes the model's own fused tensors instead
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), the other layout a folder may hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
COMMON = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "vocab_size": 256, "use_cache": False,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip


def moe_config(arch: str, *, router_aux_loss: float = 0.0):
    """A tiny transformers config of `arch` (4 experts, 2 per token); `router_aux_loss`: output_router_logits on, that coef."""
    import transformers

    qwen = {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    shapes = {
        "mixtral": ("MixtralConfig", {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}),
        "qwen2_moe": ("Qwen2MoeConfig", {**qwen, "shared_expert_intermediate_size": 64}),
        "qwen3_moe": ("Qwen3MoeConfig", {**qwen, "head_dim": 16}),
        "olmoe": ("OlmoeConfig", {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}),
        "deepseek_v3": ("DeepseekV3Config", {
            "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        }),
        "gpt_oss": ("GptOssConfig", {
            "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        }),
    }  # fmt: skip
    name, own = shapes[arch]
    config = getattr(transformers, name)(**COMMON, **own)
    if router_aux_loss:
        config.output_router_logits, config.router_aux_loss_coef = True, router_aux_loss
    return config


def make_moe_folder(
    arch: str, out: Path, *, layout: str = "per_expert", router_aux_loss: float = 0.0, seed: int = 1234
) -> Path:
    """Save a tiny `arch` MoE model with seeded random weights to `out`, its experts per expert or fused."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        moe_config(arch, router_aux_loss=router_aux_loss), dtype=torch.float32
    )
    model.save_pretrained(out)
    if layout == "fused":
        (out / "model.safetensors").unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or
                 not model.config.tie_word_embeddings}  # fmt: skip
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def weight_names(folder: Path) -> list[str]:
    """The tensor names of a folder's model.safetensors."""
    header = (folder / "model.safetensors").read_bytes()
    length = int.from_bytes(header[:8], "little")
    return sorted(k for k in json.loads(header[8 : 8 + length]) if k != "__metadata__")

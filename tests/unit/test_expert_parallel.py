"""The expert-parallel seam: `expert_sites` finds every module holding stacked routed experts, the built-in GPT's
MoE blocks and transformers 5's experts modules, with the names of the parameters expert parallelism splits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_assets import moe_config

from launcher.components.model.gpt import GPT
from launcher.config.model import ModelConfig
from launcher.config.moe import MoEConfig
from launcher.parallel.expert_parallel import expert_sites


def test_the_gpt_sites_are_its_moe_blocks() -> None:
    moe = MoEConfig(num_experts=4, top_k=2, d_ff=24, every=2)
    model = GPT(dataclasses.replace(ModelConfig(n_layer=4, n_head=2, d_model=32, max_seq_len=16), moe=moe))
    sites = expert_sites(model)
    assert {name: names for name, (_, names) in sites.items()} == {
        "blocks.1.mlp": ("w_up", "w_down"),
        "blocks.3.mlp": ("w_up", "w_down"),
    }
    assert all(module is model.get_submodule(name) for name, (module, _) in sites.items())


@pytest.mark.parametrize(
    ("arch", "names"),
    [
        ("mixtral", ("gate_up_proj", "down_proj")),
        ("qwen2_moe", ("gate_up_proj", "down_proj")),  # its shared expert is an MLP of its own, not a site
        ("gpt_oss", ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")),
    ],
)
def test_the_transformers_sites_are_its_experts_modules(arch: str, names: tuple[str, ...]) -> None:
    from transformers import AutoModelForCausalLM

    config = moe_config(arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sites = expert_sites(model)
    layers = range(config.num_hidden_layers)
    assert {name: found for name, (_, found) in sites.items()} == {
        f"model.layers.{i}.mlp.experts": names for i in layers
    }
    experts = 4
    assert all(getattr(module, n).shape[0] == experts for module, found in sites.values() for n in found)

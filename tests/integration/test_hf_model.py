"""Hugging Face causal LMs (real transformers, random weights, nothing downloaded) in the real loop."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, losses, run_cli, run_inline

pytest.importorskip("transformers")

from launcher.components.model.build import build_model  # noqa: E402
from launcher.components.model.family import decoder_layers, family_of  # noqa: E402
from launcher.components.model.hf import HFCausalLM  # noqa: E402
from launcher.config.model import ModelConfig

RUN = [*TINY, "train.eval_every=null", "checkpoint.every=null", "train.max_steps=10"]


def test_train_hf_llama_tiny_from_the_command_line(tmp_path) -> None:
    run_dir = tmp_path / "run"
    done = run_cli(["model=hf_llama_tiny", *RUN, f"run_dir={run_dir}"], cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "use_cache=False" in done.stdout
    curve = losses(run_dir)
    assert curve[10] < curve[1] - 0.3  # starts near ln(256) = 5.55 with random weights
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "completed"


def test_hf_llama_tiny_with_qlora_trains_only_adapters(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert run_inline(["model=hf_llama_tiny", "quantization=nf4_lora", *RUN], run_dir) == 0
    curve = losses(run_dir)
    assert curve[10] < curve[1]
    state = torch.load(run_dir / "checkpoints" / "step_10" / "model.pt", weights_only=True)
    assert any(k.endswith("gate_proj.lora_A.default.weight") for k in state)  # every linear of the blocks
    assert all(".lora_A." in k or ".lora_B." in k for k in state)  # only adapters: the nf4 base is rebuilt


@pytest.mark.parametrize("preset", ["llama", "gpt2"])
def test_preset_checkpointing_gives_the_same_gradients(preset: str) -> None:
    cfg = ModelConfig(kind="hf", hf_config=preset, n_layer=2, d_model=64, n_head=2)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        assert isinstance(model, HFCausalLM) and model(tokens).shape == (2, 16, 256)
        if checkpointed:
            assert family_of(model).checkpointing(model, 1, None)
        model(tokens).float().logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    gpt = build_model(ModelConfig(n_layer=1, d_model=32, n_head=2))
    assert not family_of(gpt).checkpointing(gpt, 1, None)


@pytest.mark.parametrize(("preset", "layer_class"), [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block")])
def test_decoder_layers_are_what_fsdp_shards_and_compile_traces(preset: str, layer_class: str) -> None:
    """FSDP2 and compile take a transformers model layer by layer (the class of `_no_split_modules`)."""
    from launcher.components.compile import compiled_modules

    model = build_model(ModelConfig(kind="hf", hf_config=preset, n_layer=3, d_model=32, n_head=2))
    layers = decoder_layers(model)
    assert layers is not None and len(layers) == 3 and type(layers[0]).__name__ == layer_class
    assert compiled_modules(model) == list(layers)


def test_model_path_loads_the_weights_and_hf_config_only_the_shape(tmp_path) -> None:
    torch.manual_seed(0)
    source = build_model(ModelConfig(kind="hf", hf_config="llama", n_layer=1, d_model=32, n_head=2))
    source.hf.save_pretrained(tmp_path / "llama")
    torch.manual_seed(1)  # a different seed: only loading the weights can make them equal
    loaded = build_model(ModelConfig(kind="hf", path=str(tmp_path / "llama")))
    shaped = build_model(ModelConfig(kind="hf", hf_config=str(tmp_path / "llama")))
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), source(tokens))
        assert shaped(tokens).shape == source(tokens).shape
        assert not torch.equal(shaped(tokens), source(tokens))

"""peft adapters on the built-in GPT and Hugging Face models: targets, adapter-only state, PEFT folders."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import TINY, run_inline

pytest.importorskip("peft")

from peft import PeftModel  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

from launcher.components import adapters, checkpoint, quantization  # noqa: E402
from launcher.components.model.build import build_model  # noqa: E402
from launcher.components.model.hf_files import hf_config  # noqa: E402
from launcher.config.adapters import ADAPTER, LoRAConfig  # noqa: E402
from launcher.config.model import ModelConfig  # noqa: E402
from launcher.config.quantization import QuantizationConfig  # noqa: E402
from launcher.tools import merge  # noqa: E402
from launcher.tools.adapter_folder import write_adapter_folder  # noqa: E402

SMALL = ModelConfig(n_layer=2, d_model=64, n_head=2)
RUN = [*TINY, "train.eval_every=null", "train.max_steps=4", "checkpoint.every=null"]


def _adapted(lora: LoRAConfig, cfg: ModelConfig = SMALL) -> torch.nn.Module:
    torch.manual_seed(0)
    return quantization.apply(build_model(cfg), QuantizationConfig(lora=lora), torch.float32)


def test_a_target_that_matches_nothing_is_refused_at_build() -> None:
    """Rules refuse it before launch when they know the model's layers; a local HF model is only known here."""
    with pytest.raises(ValueError, match=r"gate_proj matches none of this model's adaptable linear layers"):
        _adapted(LoRAConfig(rank=4, targets=["q_proj", "gate_proj"]))
    llama = ModelConfig(kind="hf", hf_config="llama", n_layer=1, d_model=32, n_head=2)
    with pytest.raises(ValueError, match=r"c_attn matches none .*gate_proj"):
        _adapted(LoRAConfig(rank=4, targets=["c_attn"]), llama)
    model = _adapted(LoRAConfig(rank=4, targets=["attn.q_proj", "down"]))
    assert sorted(adapters.adapter_layers(model)) == [
        f"blocks.{i}.{name}" for i in (0, 1) for name in ("attn.q_proj", "mlp.down")
    ]
    assert not any(
        name.endswith(("lm_head", "tok_emb"))
        for name in adapters.adapter_layers(_adapted(LoRAConfig(rank=4)))
    )


def test_rslora_and_dora_reach_peft() -> None:
    plain, rs = _adapted(LoRAConfig(rank=4, alpha=8)), _adapted(LoRAConfig(rank=4, alpha=8, rslora=True))
    layer, rs_layer = (next(iter(adapters.adapter_layers(m).values())) for m in (plain, rs))
    assert layer.scaling[ADAPTER] == 2.0 and rs_layer.scaling[ADAPTER] == pytest.approx(8 / math.sqrt(4))
    dora = _adapted(LoRAConfig(rank=4, dora=True))
    trainable = [n for n, p in dora.named_parameters() if p.requires_grad]
    assert sum(".lora_magnitude_vector." in n for n in trainable) == 2 * 6  # one magnitude per adapted layer


def test_dora_on_int8_fails_in_peft_as_the_rule_says() -> None:
    """Why quantization.lora.dora=true with int8 is refused before launch: the second forward breaks."""
    torch.manual_seed(0)
    cfg = QuantizationConfig(method="int8", lora=LoRAConfig(rank=4, dora=True))
    model = quantization.apply(build_model(SMALL), cfg, torch.float32)
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens)
    with pytest.raises(AttributeError):  # the int8 row scales (SCB) are gone
        model(tokens)


def test_loading_checks_that_exactly_the_frozen_keys_are_missing() -> None:
    model = _adapted(LoRAConfig(rank=4))
    state = adapters.checkpoint_state(model)
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    adapters.load_checkpoint_state(model, state)
    short = dict(state)
    short.pop("blocks.0.attn.q_proj.lora_A.default.weight")
    with pytest.raises(KeyError, match=r"missing blocks.0.attn.q_proj.lora_A.default.weight"):
        adapters.load_checkpoint_state(model, short)
    with pytest.raises(KeyError, match=r"unexpected tok_emb.weight"):
        adapters.load_checkpoint_state(model, {**state, "tok_emb.weight": model.tok_emb.weight})


@pytest.mark.parametrize(
    ("model", "lora"),
    [
        (["model.n_layer=2"], ["quantization=dora"]),
        (["model=hf", "model.path=LLAMA"], ["quantization=lora"]),
        (["model=hf_gpt2_tiny"], ["quantization=lora", "quantization.lora.rslora=true"]),
    ],
    ids=["gpt-dora", "pretrained-llama-lora", "gpt2-rslora"],
)
def test_peft_folder_loads_onto_the_base_model(tmp_path, model: list[str], lora: list[str]) -> None:
    if "model.path=LLAMA" in model:  # a pretrained folder, as save_pretrained writes one
        torch.manual_seed(1)
        build_model(
            ModelConfig(kind="hf", hf_config="llama", n_layer=1, d_model=32, n_head=2)
        ).hf.save_pretrained(tmp_path / "llama")
        model = ["model=hf", f"model.path={tmp_path / 'llama'}"]
    run_dir = tmp_path / "run"
    assert run_inline([*RUN, *model, *lora], run_dir) == 0
    folder = write_adapter_folder(run_dir, tmp_path / "adapter")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    spec, adapted = merge.load_adapted(checkpoint.good_checkpoints(run_dir)[0])
    torch.manual_seed(spec.train.seed)  # the frozen base, as the run built it
    if spec.model.kind == "hf":
        from transformers import AutoModelForCausalLM

        if spec.model.path:
            base = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32)
        else:
            base = AutoModelForCausalLM.from_config(hf_config(spec.model), dtype=torch.float32)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == spec.model.path
    else:
        base = build_model(spec.model)
    loaded = PeftModel.from_pretrained(base, folder).eval()
    assert sum(isinstance(m, LoraLayer) for m in loaded.modules()) == len(adapters.adapter_layers(adapted))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def logits() -> torch.Tensor:
        out = loaded(input_ids=tokens)
        return out.logits if spec.model.kind == "hf" else out

    with torch.no_grad():
        want, got = adapted(tokens), logits()
        with loaded.disable_adapter():
            without = logits()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (without - want).abs().max() > 1e-4  # the adapters trained: they move the logits

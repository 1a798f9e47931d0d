"""What a Hugging Face model option is, read from presets and local files: no torch, no model built.

The rules and the dry run read these (a folder's config.json, its weight files, a preset's linear
layers, a config's tensor-parallel plan) in the launching process; building the module
(launcher.components.model.hf) is a rank's business. `hf_config` imports transformers, so only runs with
`model.kind=hf` pay for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.components.files.safe_load import RefusedFile
from launcher.config.model import FAMILIES, ModelConfig, ff_width, vocab_size

PRESETS = ("llama", "gpt2")
# The linear layers of each preset's blocks, by name suffix (what quantization and LoRA may target).
PRESET_LINEARS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _preset_config(cfg: ModelConfig) -> Any:
    """The transformers config of a preset, shaped by the model group's keys."""
    from transformers import GPT2Config, LlamaConfig

    common = {"vocab_size": vocab_size(cfg), "tie_word_embeddings": cfg.tie_embeddings, "use_cache": False}
    common |= {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if cfg.hf_config == "llama":
        return LlamaConfig(
            hidden_size=cfg.d_model, intermediate_size=ff_width(cfg), num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
            max_position_embeddings=cfg.max_seq_len, attention_bias=cfg.bias, mlp_bias=cfg.bias,
            attention_dropout=cfg.dropout, **common,
        )  # fmt: skip
    return GPT2Config(
        n_embd=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=ff_width(cfg),
        n_positions=cfg.max_seq_len, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, **common,
    )  # fmt: skip


def is_preset(name: str | None) -> bool:
    """Whether `model.hf_config` names a preset rather than a directory."""
    return name in PRESETS


def local_dir(cfg: ModelConfig) -> str | None:
    """The local folder whose config.json shapes the model (model.path, else a directory hf_config); None for presets.

    The model's family says (launcher.components.model.family): a family without folders has none, and an
    unknown model.kind none either (the launching process asks before the rules name the kind).
    """
    from launcher.components.model.family import family

    return family(cfg).folder(cfg) if cfg.kind in FAMILIES else None


def read_local_config(path: str) -> dict[str, Any]:
    """The raw config.json of a local model directory (no transformers import needed)."""
    return json.loads((Path(path) / "config.json").read_text())


NO_REMOTE_CODE = (
    "The launcher never runs code from a model or tokenizer folder (trust_remote_code stays off): use one whose "
    "architecture transformers ships, or convert it to one."
)


def custom_code_problem(path: str) -> str | None:
    """Why a local folder's config.json needs code of its own (auto_map for a model_type transformers lacks), or None.

    transformers ignores auto_map for an architecture it ships (trust_remote_code stays off); any
    other would need the folder's Python files, which the launcher never runs.
    """
    try:
        config = read_local_config(path)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" not in config:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return None
    return (
        f"it names code of its own (auto_map {config['auto_map']} for model_type {model_type!r}, which "
        "transformers does not ship)"
    )


def refuse_custom_code(path: str) -> None:
    """RefusedFile naming `path`/config.json when it needs code of its own (custom_code_problem)."""
    problem = custom_code_problem(path)
    if problem:
        raise RefusedFile(Path(path) / "config.json", problem, True, advice=NO_REMOTE_CODE)


def local_vocab_size(path: str) -> int | None:
    """The vocab_size of a local model directory's config.json; None when it cannot be read."""
    try:
        return int(read_local_config(path)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def has_weights(path: str) -> bool:
    """Whether a local model directory holds weights to load."""
    return any((Path(path) / name).is_file() for name in WEIGHT_FILES)


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config `cfg` describes, with the key-value cache off."""
    from transformers import AutoConfig

    folder = local_dir(cfg)
    if folder is None:
        config = _preset_config(cfg)
    else:
        refuse_custom_code(folder)
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    config.use_cache = False
    return config


# transformers' names of tensor-parallel styles (a config class's base_model_tp_plan) this launcher applies.
TP_STYLES = ("colwise", "rowwise")
TP_LAYER_PREFIX = "layers.*."


EXPERTS_IN_PLAN = ".mlp.experts"
"""Where a MoE family's plan splits its routed experts: left out, the experts stay whole on every tp rank."""


def _own_plan(config: Any) -> dict[str, str]:
    """The config's base_model_tp_plan less its routed-expert entries (tensor parallelism splits the dense parts)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return {k: v for k, v in plan.items() if EXPERTS_IN_PLAN not in k}


def tp_plan_problem(config: Any) -> str | None:
    """Why the transformers config's own tensor-parallel plan cannot split its decoder layers; None if it can."""
    plan = _own_plan(config)
    name = type(config).__name__.removesuffix("Config")
    if not plan:
        return f"{name} comes with no tensor-parallel plan (transformers' base_model_tp_plan is empty)"
    foreign = {k: v for k, v in plan.items() if not k.startswith(TP_LAYER_PREFIX) or v not in TP_STYLES}
    if foreign:
        listed = ", ".join(f"{k}: {v}" for k, v in foreign.items())
        return f"{name}'s plan has entries this launcher does not apply ({listed}; it splits decoder layers colwise/rowwise)"
    return None


def layer_tp_plan(config: Any) -> dict[str, str]:
    """Style (colwise/rowwise) per module name inside one decoder layer, from the config's own plan (experts left whole)."""
    plan = _own_plan(config)
    return {k.removeprefix(TP_LAYER_PREFIX): v for k, v in plan.items()}


def llama_layout(config: Any) -> bool:
    """True when the config's layer plan splits only self_attn.* and mlp.* (Llama's layout, which sequence parallelism needs)."""
    from launcher.components.model.hf_experts import num_experts

    plan = layer_tp_plan(config)
    dense = not num_experts(config)  # a MoE block routes tokens: it takes no sequence shard
    return dense and bool(plan) and all(name.startswith(("self_attn.", "mlp.")) for name in plan)

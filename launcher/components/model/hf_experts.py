"""Mixture-of-Experts facts of a Hugging Face family (Mixtral, Qwen2-MoE, Qwen3-MoE, ...), read without torch.

transformers 5 keeps each MoE layer's experts fused, `mlp.experts.gate_up_proj` [E, 2F, D] and
`mlp.experts.down_proj` [E, D, F], and converts a folder's per-expert tensors (`experts.N.w1/w2/w3`
for Mixtral, `experts.N.gate_proj/up_proj/down_proj` for the Qwen and DeepSeek families: what its own
`save_pretrained` writes) while it loads them, by its checkpoint conversion mapping. `fused_shapes`
applies the same mapping to a folder's tensor shapes, so the rules compare a folder of either layout
with the model its config.json builds before launch.

The router's auxiliary load-balancing loss is on when config.json sets `output_router_logits`, weighted
by `router_aux_loss_coef` (transformers' own keys; launcher.rank.router_loss adds it to the objective).
Active parameters count the experts a token is routed to (`num_experts_per_tok` of `num_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"})
"""model_types whose MoE layers the launcher loads, trains and exports (checked against transformers by tests)."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config keys by which a transformers family says its layers hold several experts."""
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")
"""config keys naming how many experts each token is routed to."""
FUSED = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
"""The fused expert parameters of transformers' experts modules (inside `mlp.experts`)."""

Shapes = dict[str, tuple[int, ...]]


def _value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer of a transformers config (or its config.json dict); 0 for a dense model."""
    for key in EXPERT_KEYS:
        value = _value(config, key)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def experts_per_token(config: Any) -> int:
    """How many routed experts each token reaches (1 when the config does not say)."""
    for key in TOP_K_KEYS:
        value = _value(config, key)
        if isinstance(value, int) and value > 0:
            return value
    return 1


def router_aux_coef(config: Any) -> float:
    """The weight of the router's load-balancing loss in the training loss: 0 unless output_router_logits is on."""
    if not _value(config, "output_router_logits"):
        return 0.0
    return float(_value(config, "router_aux_loss_coef") or 0.0)


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter name is a fused routed-expert tensor (not the router, not a shared expert)."""
    return ".experts." in name and name.rsplit(".", 1)[-1] in FUSED


def active_parameters(total: int, expert_params: int, config: Any) -> int:
    """Parameters one token runs through: the total less the routed experts it is not sent to."""
    experts = num_experts(config)
    if not experts:
        return total
    idle = expert_params * (experts - min(experts_per_token(config), experts)) // experts
    return total - idle


def _pattern(source: str) -> re.Pattern[str]:
    """A conversion source pattern (`*` for the expert index) as a regex capturing that index."""
    return re.compile(re.escape(source).replace(r"\*", r"(\d+)"))


def _merge(found: Shapes, sources: list[str], target: str, concat_dim: int | None) -> Shapes | None:
    """Replace the per-expert tensors that `sources` match by the fused `target` tensor per layer.

    MergeModulelist stacks the experts (a new dim 0); Concatenate then joins the sources along
    `concat_dim` of the stacked tensor. None when the matched shapes cannot be fused as transformers would.
    """
    groups: dict[str, dict[int, dict[int, tuple[int, ...]]]] = {}
    patterns = [_pattern(s) for s in sources]
    rest: Shapes = {}
    for name, shape in found.items():
        for index, pattern in enumerate(patterns):
            match = pattern.search(name)
            if match:
                groups.setdefault(name[: match.start()], {}).setdefault(index, {})[int(match.group(1))] = (
                    shape
                )
                break
        else:
            rest[name] = shape
    for prefix, per_source in groups.items():
        stacked = []
        for index in range(len(sources)):
            experts = per_source.get(index, {})
            shapes = set(experts.values())
            if sorted(experts) != list(range(len(experts))) or len(shapes) != 1:
                return None
            stacked.append((len(experts), *shapes.pop()))
        fused = list(stacked[0])
        if concat_dim is not None:
            fused[concat_dim] = sum(s[concat_dim] for s in stacked)
        rest[prefix + target] = tuple(fused)
    return rest


def fused_shapes(found: Shapes, model_type: str) -> Shapes | None:
    """A folder's tensor shapes as transformers loads them: per-expert tensors fused, as its conversion mapping says.

    Folders already fused pass unchanged. None when the mapping holds an operation not read here (the rank's
    own load, transformers', converts it then).
    """
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    shapes = dict(found)
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(rule, WeightRenaming):
            for source, target in zip(rule.source_patterns, rule.target_patterns, strict=False):
                shapes = {re.sub(source, target, name): shape for name, shape in shapes.items()}
        elif isinstance(rule, WeightConverter):
            ops = rule.operations
            if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
                return None
            if len(ops) > 2 or (len(ops) == 2 and not isinstance(ops[1], Concatenate)):
                return None
            concat = ops[1].dim if len(ops) == 2 else None
            merged = _merge(shapes, list(rule.source_patterns), rule.target_patterns[0], concat)
            if merged is None:
                return None
            shapes = merged
    return shapes

"""The routing record of a Hugging Face MoE folder's layers: per-layer expert load, as the built-in GPT's.

transformers 5's MoE layers hand their experts module the chosen experts of every token
(`experts(hidden_states, top_k_index, top_k_weights)`). A forward pre-hook on each experts module counts
them in forwards that build a graph: training, not evaluation or decoding (no gradients there), nor
activation checkpointing's recomputation in backward (a folder's modules may stay in eval mode while
training, so their `training` flag cannot decide). Each log step turns the interval's counts, summed
over the data-parallel ranks, into `moe_load/<layer>` (the most loaded expert's assignments over the
mean) and `moe_load_max_over_mean` (the highest of the layers): the numbers the advisor's
router-collapse rule reads. Under expert parallelism a rank counts its own tokens' choices before they
travel, so the sum is the global load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launcher.components.model.moe import in_backward

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""A decoder layer's index in a transformers module name (`model.layers.3.mlp.experts`)."""


def _experts_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> that layer's experts module (fused routed experts with a `num_experts`)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        match = LAYER.search(name)
        fused = hasattr(module, "gate_up_proj") and isinstance(getattr(module, "num_experts", None), int)
        if match and name.endswith("experts") and fused:
            found.setdefault(int(match.group(1)), module)
    return found


class HFRouting:
    """Counts each layer's expert choices in training forwards; records the load at each log step."""

    def __init__(self, modules: dict[int, nn.Module], data_sum: Callable[[list[float]], list[float]]) -> None:
        self.data_sum = data_sum
        self.layout = {i: m.num_experts for i, m in sorted(modules.items())}
        self.counts = {i: torch.zeros(e, dtype=torch.float64) for i, e in self.layout.items()}
        for index, module in modules.items():
            module.register_forward_pre_hook(self._hook(index), with_kwargs=True)

    def _hook(self, index: int) -> Callable[..., None]:
        def count(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not torch.is_grad_enabled() or in_backward():  # evaluation, decoding, recomputation
                return
            chosen = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if chosen is None:
                return
            hits = torch.bincount(chosen.reshape(-1).long(), minlength=self.layout[index])[
                : self.layout[index]
            ]
            self.counts[index] += hits.detach().to("cpu", torch.float64)

        return count

    def before_step(self, step: int) -> None:
        """Nothing: the counts run over the log interval."""

    def after_step(self, step: int) -> None:
        """Nothing: a folder's routers have no loss-free balancing bias."""

    def record(self) -> dict[str, float]:
        """The log interval's per-layer load (summed over the data-parallel ranks), then a new interval."""
        values = self.data_sum([v for counts in self.counts.values() for v in counts.tolist()])
        record: dict[str, float] = {}
        at = 0
        for index, experts in self.layout.items():
            counts = values[at : at + experts]
            at += experts
            mean = sum(counts) / experts
            record[f"moe_load/{index}"] = max(counts) / mean if mean else 0.0
        for counts in self.counts.values():
            counts.zero_()
        return {"moe_load_max_over_mean": max(record.values()), **record}


def routing(model: nn.Module, data_sum: Callable[[list[float]], list[float]]) -> HFRouting | None:
    """The routing record of a transformers model's MoE layers (None for a dense one)."""
    modules = _experts_modules(model)
    return HFRouting(modules, data_sum) if modules else None

"""Loss-free load balancing of the MoE blocks, and what the run records of their routing.

`MoEBalance` is the loop's hooks for a model with MoE blocks (launcher.components.model.moe):

- before each step, every block's step counts restart (a micro-batch search's probes count nothing);
- after each optimizer step, with model.moe.bias_update_rate > 0, the step's expert counts are summed over
  every rank (one all-reduce for all blocks: each rank routes its own tokens) and each block's routing bias
  moves by the rate towards the mean load (DeepSeek-V3, as torchtitan: sign(mean - count), centred), so the
  bias is the same on every rank and is checkpointed with the model (a buffer);
- at each log step, the interval's sums over the data-parallel ranks become `moe_load_max_over_mean` (the
  most loaded expert's tokens over the mean, the highest of the blocks), `moe_load/<block>` per block,
  `moe_dropped_tokens` (assignments over capacity), `moe_aux_loss` and `moe_z_loss` (their unweighted
  per-sequence means, averaged over the blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from launcher.components.model.moe import MoE

DataSum = Callable[[list[float]], list[float]]
"""Sums plain numbers over data-parallel groups, each counted once (DistContext.data_sum)."""


def moe_blocks(model: nn.Module) -> dict[int, MoE]:
    """The MoE feed-forward parts of `model` by block index (empty for a dense model)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return {}
    items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    return {int(i): block.mlp for i, block in items if isinstance(getattr(block, "mlp", None), MoE)}


class MoEBalance:
    """The bias update after each step and the routing record of each log step, over a model's MoE blocks."""

    def __init__(self, blocks: dict[int, MoE], *, rate: float, world_size: int, data_sum: DataSum) -> None:
        self.blocks, self.rate, self.world_size, self.data_sum = blocks, rate, world_size, data_sum

    def before_step(self, step: int) -> None:
        """Restart every block's step counts."""
        for block in self.blocks.values():
            block.step_counts = torch.zeros_like(block.step_counts)

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Move each block's routing bias towards balance by the step's counts over all ranks (rate 0: nothing)."""
        if self.rate == 0 or not self.blocks:
            return
        counts = torch.stack([block.step_counts.float() for block in self.blocks.values()])
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        for block, load in zip(self.blocks.values(), counts, strict=True):
            delta = self.rate * torch.sign(load.mean() - load)
            bias = block.router.expert_bias
            bias.add_((delta - delta.mean()).to(bias.device, bias.dtype))

    def record(self) -> dict[str, float]:
        """The log interval's routing numbers (summed over the data-parallel ranks), then a new interval."""
        if not self.blocks:
            return {}
        values: list[float] = []
        for block in self.blocks.values():
            sums = block.interval
            values += [*sums["counts"].tolist(), *(float(sums[k]) for k in ("dropped", "aux", "z", "rows"))]
            block.reset_interval()
        values = self.data_sum(values)
        record: dict[str, float] = {}
        dropped = aux = z = 0.0
        at = 0
        for index, block in self.blocks.items():
            counts = values[at : at + block.num_experts]
            d, a, zz, rows = values[at + block.num_experts : at + block.num_experts + 4]
            at += block.num_experts + 4
            mean = sum(counts) / len(counts)
            record[f"moe_load/{index}"] = max(counts) / mean if mean else 0.0
            dropped, aux, z = dropped + d, aux + a / max(rows, 1), z + zz / max(rows, 1)
        return {
            "moe_load_max_over_mean": max(record.values()),
            **record,
            "moe_dropped_tokens": dropped,
            "moe_aux_loss": aux / len(self.blocks),
            "moe_z_loss": z / len(self.blocks),
        }

"""Loss-free load balancing of the MoE blocks, and what the run records of their routing.

`MoEBalance` is the loop's hooks for a model with MoE blocks (launcher.components.model.moe):

- before each step, every block's step counts restart (a micro-batch search's probes count nothing);
- after each optimizer step, with model.moe.bias_update_rate > 0, the step's expert counts are summed over
  every rank (one all-reduce for all blocks: each rank routes its own tokens) and each block's routing bias
  moves by the rate towards the mean load (DeepSeek-V3, as torchtitan: sign(mean - count), centred), so the
  bias is the same on every rank and is checkpointed with the model (a buffer);
- under a pipeline each stage holds some blocks: both collectives run over every block of the model
  (`layout`), a stage adding zeros for the blocks it does not hold;
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
    """The MoE feed-forward parts of `model` by block index in the whole model (empty for a dense model).

    A pipeline stage's blocks are registered under their index in the whole model (StageLayers).
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return {}
    items = blocks.named_children()
    return {int(i): block.mlp for i, block in items if isinstance(getattr(block, "mlp", None), MoE)}


class MoEBalance:
    """The bias update after each step and the routing record of each log step, over a model's MoE blocks."""

    def __init__(
        self, blocks: dict[int, MoE], *, rate: float, world_size: int, data_sum: DataSum,
        layout: dict[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.blocks, self.rate, self.world_size, self.data_sum = blocks, rate, world_size, data_sum
        self.layout = layout if layout is not None else {i: b.num_experts for i, b in blocks.items()}
        """Every MoE block of the model (index -> experts), here or on another pipeline stage: the collectives'
        layout, the same on every rank (a stage sends zeros for the blocks it does not hold)."""
        device = next(iter(blocks.values())).router.expert_bias.device if blocks else None
        self.device = device or torch.device("cpu")

    def before_step(self, step: int) -> None:
        """Restart every block's step counts."""
        for block in self.blocks.values():
            block.step_counts = torch.zeros_like(block.step_counts)

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Move each block's routing bias towards balance by the step's counts over all ranks (rate 0: nothing)."""
        if self.rate == 0 or not self.layout:
            return
        counts = torch.stack([self._held(i, e) for i, e in self.layout.items()])
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        for index, load in zip(self.layout, counts, strict=True):
            block = self.blocks.get(index)
            if block is None:
                continue
            delta = self.rate * torch.sign(load.mean() - load)
            bias = block.router.expert_bias
            bias.add_((delta - delta.mean()).to(bias.device, bias.dtype))

    def record(self) -> dict[str, float]:
        """The log interval's routing numbers (summed over the data-parallel ranks), then a new interval."""
        if not self.layout:
            return {}
        values: list[float] = []
        for index, experts in self.layout.items():
            block = self.blocks.get(index)
            if block is None:
                values += [0.0] * (experts + 4)
                continue
            sums = block.interval
            values += [*sums["counts"].tolist(), *(float(sums[k]) for k in ("dropped", "aux", "z", "rows"))]
            block.reset_interval()
        values = self.data_sum(values)
        record: dict[str, float] = {}
        dropped = aux = z = 0.0
        at = 0
        for index, experts in self.layout.items():
            counts = values[at : at + experts]
            d, a, zz, rows = values[at + experts : at + experts + 4]
            at += experts + 4
            mean = sum(counts) / len(counts)
            record[f"moe_load/{index}"] = max(counts) / mean if mean else 0.0
            dropped, aux, z = dropped + d, aux + a / max(rows, 1), z + zz / max(rows, 1)
        return {
            "moe_load_max_over_mean": max(record.values()),
            **record,
            "moe_dropped_tokens": dropped,
            "moe_aux_loss": aux / len(self.layout),
            "moe_z_loss": z / len(self.layout),
        }

    def _held(self, index: int, experts: int) -> torch.Tensor:
        """Block `index`'s counts of this step (zeros where another pipeline stage holds it)."""
        block = self.blocks.get(index)
        return block.step_counts.float() if block is not None else torch.zeros(experts, device=self.device)

"""The prune group: gradual magnitude pruning (unstructured or 2:4) of the blocks' linear weights.

Which weights: the weight matrices of the transformer blocks' linear layers (q/k/v/o projections
and the MLP), as `quantization.quantizable_linears` finds them; embeddings, the output head (tied
to the token embedding), norms and biases are never pruned.

How: each pruned layer gets a `prune_mask` buffer (uint8, 1 byte per weight: 1 keeps, 0 prunes).
Being a buffer, it is part of the model's state dict, so every strategy's checkpoint saves and
restores it with the weights and a resume is bitwise exact. An after-step hook (launcher.rank.engine
calls it after every optimizer step) multiplies each weight by its mask, so a pruned weight is
exactly zero after every step whatever AdamW's momentum or weight decay would make of it, and at
the schedule's steps recomputes the masks from the weights' magnitudes with the cubic schedule of
Zhu & Gupta (2017): s_t = s_f (1 - (1 - (t - t0) / (t1 - t0))^3), every `every` steps from
`start_step` to `end_step` (and at `end_step` itself). The masks are computed here rather than by
torchao's WeightNormSparsifier: that keeps masks in torch parametrizations (the weight becomes a
computed property, renamed `parametrizations.weight.original` in the state dict) and keeps its own
schedule state, while a plain buffer and a stateless schedule need nothing beyond the model's
state dict to resume exactly, under every strategy that saves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.config.prune import GROUP_2_4, MASK, PruneConfig

if TYPE_CHECKING:  # torch only on a rank: the launching process never needs it
    import torch
    from torch import nn


def sparsity_at(cfg: PruneConfig, step: int) -> float:
    """The schedule's sparsity after optimizer step `step` (cubic, Zhu & Gupta 2017; s_i = 0)."""
    if cfg.method == "none" or step <= cfg.start_step:
        return 0.0
    if step >= cfg.end_step:
        return cfg.target_sparsity
    last = cfg.start_step + (step - cfg.start_step) // cfg.every * cfg.every  # the latest update step
    progress = (last - cfg.start_step) / (cfg.end_step - cfg.start_step)
    return cfg.target_sparsity * (1.0 - (1.0 - progress) ** 3)


def updates_at(cfg: PruneConfig, step: int) -> bool:
    """Whether the masks are recomputed after optimizer step `step`."""
    if cfg.method == "none" or not cfg.start_step < step <= cfg.end_step:
        return False
    return step == cfg.end_step or (step - cfg.start_step) % cfg.every == 0


def _magnitude_scores(weight: torch.Tensor, method: str) -> torch.Tensor:
    """|w|, with the weights 2:4 keeps in any case (the 2 largest of each 4) raised to +inf."""
    import torch

    scores = weight.detach().abs().float()
    if method != "2_4":
        return scores
    groups = scores.reshape(-1, GROUP_2_4)
    kept = groups.topk(2, dim=1).indices  # ties go to the lower index, the same on every rank
    return groups.scatter(1, kept, torch.inf).reshape(scores.shape)


def _masks(scores: dict[str, torch.Tensor], sparsity: float, scope: str) -> dict[str, torch.Tensor]:
    """uint8 masks zeroing round(sparsity x n) lowest scores, over all layers (global) or in each."""
    import torch

    def lowest(flat: torch.Tensor, count: int) -> torch.Tensor:
        mask = torch.ones_like(flat, dtype=torch.uint8)
        if count > 0:  # a stable sort: equal scores are pruned in index order, deterministically
            mask[flat.argsort(stable=True)[:count]] = 0
        return mask

    if scope == "per_layer":
        return {
            name: lowest(s.flatten(), round(sparsity * s.numel())).view(s.shape) for name, s in scores.items()
        }
    flat = torch.cat([s.flatten() for s in scores.values()])
    parts = lowest(flat, round(sparsity * flat.numel())).split([s.numel() for s in scores.values()])
    return {name: part.view(s.shape) for (name, s), part in zip(scores.items(), parts, strict=True)}


class Pruner:
    """The masks of one model's pruned layers and the after-step hook that updates and applies them."""

    def __init__(self, layers: dict[str, nn.Linear], cfg: PruneConfig) -> None:
        self.layers, self.cfg = layers, cfg

    def after_step(self, step: int) -> None:
        """Recompute the masks at the schedule's steps; zero the pruned weights after every step."""
        import torch

        with torch.no_grad():
            if updates_at(self.cfg, step):
                scores = {n: _magnitude_scores(m.weight, self.cfg.method) for n, m in self.layers.items()}
                scope = "per_layer" if self.cfg.method == "2_4" else self.cfg.scope
                for name, mask in _masks(scores, sparsity_at(self.cfg, step), scope).items():
                    getattr(self.layers[name], MASK).copy_(mask)
            for layer in self.layers.values():
                layer.weight.mul_(getattr(layer, MASK).to(layer.weight.dtype))

    def record(self) -> dict[str, float]:
        """`sparsity` (share of zero weights in the pruned layers) and `sparsity/<layer>` for the metrics."""
        zeros = {name: int((layer.weight == 0).sum()) for name, layer in self.layers.items()}
        total = sum(layer.weight.numel() for layer in self.layers.values())
        per_layer = {f"sparsity/{n}": round(z / self.layers[n].weight.numel(), 6) for n, z in zeros.items()}
        return {"sparsity": round(sum(zeros.values()) / max(total, 1), 6), **per_layer}


def apply(model: nn.Module, cfg: PruneConfig) -> Pruner | None:
    """Give each of the blocks' linear layers an all-ones mask buffer; None when nothing is pruned.

    Runs before any strategy wraps the model (launcher.rank.build), so the buffers are in every
    checkpoint the strategy writes.
    """
    if cfg.method == "none":
        return None
    import torch

    from launcher.components.quantization import quantizable_linears

    layers = quantizable_linears(model)
    for layer in layers.values():
        layer.register_buffer(MASK, torch.ones_like(layer.weight, dtype=torch.uint8))
    # DDP would broadcast every buffer from rank 0 before each forward (1 byte per pruned weight, a
    # quarter of those weights' gradient all-reduce): the masks are computed on every rank from the
    # same weights by the same deterministic sort, so they are equal without it.
    model._ddp_params_and_buffers_to_ignore = [f"{name}.{MASK}" for name in layers]
    return Pruner(layers, cfg)


def without_masks(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the mask buffers: the zeros are in the weights, which makes the pruning permanent."""
    return {key: value for key, value in state.items() if key.rsplit(".", 1)[-1] != MASK}

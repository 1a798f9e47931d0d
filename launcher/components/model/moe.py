"""The built-in GPT's mixture-of-experts block (model.moe.*): a router, stacked experts and a shared MLP.

Each token's router logits become expert scores (softmax over the experts, or an independent sigmoid
per expert); the top_k experts by score plus the loss-free balancing bias (DeepSeek-V3: the bias only
chooses, the weights are the unbiased scores, renormalized over the chosen when top_k > 1) take it.
The experts are stacked weights [E, d_model, d_ff] and [E, d_ff, d_model]; the token copies are sorted
by expert and each expert multiplies its contiguous rows (launcher.components.model.experts; under
expert parallelism on the ranks holding the experts). Dropless by default; with moe.capacity_factor an
expert keeps the first ceil(factor x assignments / E) of a micro batch's assignments in token order and
the rest are dropped.

The auxiliary losses (load balancing, Switch/Mixtral form, and the router z-loss) are computed per
sequence (row; under context parallel its sums added over the group), so a step's loss does not depend on how its rows are split over ranks and micro batches;
a training forward leaves them in `pending` for the objective (launcher.components.objectives.auxiliary)
and adds its expert counts to `step_counts` (the bias update, launcher.components.model.moe_balance) and
to the log interval's sums. Forwards without gradients (evaluation, decoding) and the recomputation of
activation checkpointing in backward keep nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.components.model.context_parallel import ContextGroup
from launcher.components.model.experts import ExpertGroup, dispatch_compute_combine, expert_mlp
from launcher.config.model import ModelConfig, expert_width


def in_backward() -> bool:
    """Whether autograd's engine is running this code (activation checkpointing recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Top-k routing: scores, chosen experts and their weights; the loss-free balancing bias as a buffer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.kind = cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router
        self.gate = nn.Linear(cfg.d_model, self.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [N, d] -> (logits [N, E] fp32, probabilities [N, E], chosen experts [N, k], their weights [N, k])."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.kind == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if self.kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        return logits, probs, chosen, weights


class MoE(nn.Module):
    """The feed-forward part of an MoE block: routed experts (stacked weights) and an optional shared MLP."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None) -> None:
        super().__init__()
        moe, width = cfg.moe, expert_width(cfg)
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.router = Router(cfg)
        self.w_up = nn.Parameter(torch.empty(moe.num_experts, cfg.d_model, width))
        self.w_down = nn.Parameter(torch.empty(moe.num_experts, width, cfg.d_model))
        self.shared = shared
        self.dropout = nn.Dropout(cfg.dropout)
        self.context_parallel: ContextGroup | None = None
        """Set under context parallel (launcher.parallel.parallelize): the auxiliary losses sum each row over it."""
        self.expert_group: ExpertGroup | None = None
        """Set under expert parallelism (launcher.parallel.expert_parallel): w_up and w_down hold this rank's experts."""
        self.pending: torch.Tensor | None = None
        """The last training forward's weighted auxiliary losses per row [B] (the objective takes them)."""
        self.step_counts = torch.zeros(moe.num_experts)
        """Token assignments each expert received in this step's training forwards (this rank's tokens)."""
        self.interval: dict[str, torch.Tensor] = {}
        """Sums since the last log step: counts [E], dropped, aux and z (summed over rows), rows."""
        self.reset_interval()

    def init_weights(self, std: float, residual_std: float) -> None:
        """GPT-2's init: N(0, std) into the experts, N(0, residual_std) into their output projections."""
        nn.init.normal_(self.w_up, mean=0.0, std=std)
        nn.init.normal_(self.w_down, mean=0.0, std=residual_std)
        if self.shared is not None:
            nn.init.normal_(self.shared.down.weight, mean=0.0, std=residual_std)

    def reset_interval(self) -> None:
        """Start a new log interval's sums."""
        device = self.step_counts.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.interval = {
            "counts": torch.zeros(self.num_experts, dtype=torch.float64, device=device),
            "dropped": zero.clone(), "aux": zero.clone(), "z": zero.clone(), "rows": zero.clone(),
        }  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]: the routed experts' weighted sum (plus the shared MLP's output)."""
        batch, seq, d = x.shape
        flat = x.reshape(-1, d)
        logits, probs, chosen, weights = self.router(flat)
        keep = self._kept(chosen)
        assigned = chosen.reshape(-1)[keep]
        order = torch.argsort(assigned, stable=True)
        token = keep.nonzero().squeeze(1)[order] // self.top_k
        counts = torch.bincount(assigned, minlength=self.num_experts)
        if self.expert_group is None:
            rows = expert_mlp(flat[token], self.w_up, self.w_down, counts.tolist())
        else:  # this rank's experts (under FSDP2 DTensor slices of the whole)
            w_up, w_down = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w_up, self.w_down))
            rows = dispatch_compute_combine(flat[token], counts, w_up, w_down, self.expert_group)
        combined = x.new_zeros(x.shape)  # not a view of the flat rows: FSDP2 warns of a module returning one
        combined.view(-1, d).index_add_(
            0, token, rows * weights.reshape(-1)[keep][order, None].to(rows.dtype)
        )
        if self.training and torch.is_grad_enabled():
            self._account(logits, probs, chosen, counts, batch, seq)
        out = combined
        if self.shared is not None:
            out = out + self.shared(x)
        return self.dropout(out)

    def _kept(self, chosen: torch.Tensor) -> torch.Tensor:
        """Which of the [N * k] assignments an expert takes (all, dropless; else the first `capacity` per expert)."""
        flat = chosen.reshape(-1)
        if self.capacity_factor is None:
            return torch.ones_like(flat, dtype=torch.bool)
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.num_experts)
        one_hot = F.one_hot(flat, self.num_experts)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
        return position < capacity

    def _account(
        self, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor,
        batch: int, seq: int,
    ) -> None:  # fmt: skip
        """A training forward's per-row auxiliary losses (`pending`), this step's counts and the interval's sums.

        Activation checkpointing's recomputation computes the losses again (it must save what the forward
        saved) and keeps nothing: the forward's own losses are the ones the objective took.
        """
        hits = F.one_hot(chosen, self.num_experts).sum(1).reshape(batch, seq, -1).float()  # [B, T, E]
        if self.context_parallel is None:
            load = hits.mean(1) / self.top_k  # fraction of each row's assignments per expert
            mean_probs = probs.reshape(batch, seq, -1).mean(1)
            z = torch.logsumexp(logits, -1).square().reshape(batch, seq).mean(1)  # [B]
        else:
            load, mean_probs, z = self._whole_rows(hits, probs, logits, batch, seq)
        aux = self.num_experts * (load * mean_probs).sum(-1)  # [B]
        pending = self.aux_loss_coef * aux + self.z_loss_coef * z
        if in_backward():
            return
        self.pending = pending
        with torch.no_grad():
            self.step_counts = self.step_counts.to(counts.device) + counts
            sums = self.interval
            sums["counts"] += counts.to(torch.float64)
            sums["dropped"] += chosen.numel() - counts.sum()
            sums["aux"] += aux.detach().sum().double()
            sums["z"] += z.detach().sum().double()
            sums["rows"] += batch

    def _whole_rows(
        self, hits: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor, batch: int, seq: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Context parallel: each row's load, mean probabilities and z-loss over its whole sequence.

        This rank holds chunks of every row; the per-row sums are added over the group (differentiably:
        the gradient of every rank's term reaches each rank's router), so every rank of the group holds the
        whole row's auxiliary losses, which the objective weights by this rank's trained tokens of the row.
        """
        from torch.distributed._functional_collectives import all_reduce, wait_tensor

        group, experts = self.context_parallel, self.num_experts
        sums = torch.cat(
            [
                hits.sum(1) / self.top_k,
                probs.reshape(batch, seq, -1).sum(1),
                torch.logsumexp(logits, -1).square().reshape(batch, seq).sum(1, keepdim=True),
            ],
            dim=-1,
        )  # [B, 2E + 1]
        sums = wait_tensor(all_reduce(sums, "sum", group.group)) / (seq * group.size)
        load, mean_probs, z = sums.split([experts, experts, 1], dim=-1)
        return load, mean_probs, z.squeeze(-1)

    def take_pending(self) -> torch.Tensor | None:
        """The last training forward's weighted auxiliary losses per row, handed over once."""
        pending, self.pending = self.pending, None
        return pending

    def _apply(self, fn: Any, recurse: bool = True) -> MoE:
        """Move the step's and the interval's sums with the module (they are not buffers: never checkpointed)."""
        super()._apply(fn, recurse)
        device = self.router.expert_bias.device
        self.step_counts = torch.zeros(self.num_experts, device=device)
        self.reset_interval()
        return self

"""The model group's `moe` sub-config: routed experts in the built-in GPT's blocks (model.moe.*).

model.moe.num_experts=0 (the default) keeps every block a dense MLP; above 0, every `every`-th block
replaces its MLP with a router and `num_experts` expert MLPs (launcher.components.model.moe).
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTERS = ("softmax", "sigmoid")
"""model.moe.router's options: how a token's router logits become expert scores."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts blocks of the built-in GPT: experts, routing and load balancing."""

    num_experts: int = 0
    """Routed experts per MoE block; 0: a dense model (every block an MLP)."""
    top_k: int = 2
    """Experts each token is sent to (their outputs summed, weighted by the router's scores)."""
    shared_experts: int = 0
    """Experts every token goes through besides the routed ones (one MLP shared_experts x moe.d_ff wide); 0: none."""
    every: int = 1
    """Dense/MoE interleave: block i (0-based) is an MoE block when (i + 1) is a multiple of it (1: every block)."""
    d_ff: int | None = None
    """Hidden width of each expert MLP; null: model.d_ff (4 * d_model)."""
    router: str = "softmax"
    """softmax (Mixtral: scores over all experts) or sigmoid (DeepSeek-V3: an independent score per expert)."""
    aux_loss_coef: float = 0.0
    """Weight of the auxiliary load-balancing loss (Switch/Mixtral form: num_experts x sum of load x score); 0: off."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean squared logsumexp of the router logits, ST-MoE); 0: off."""
    bias_update_rate: float = 0.0
    """Loss-free balancing (DeepSeek-V3): each step every expert's routing bias moves by this much towards the
    mean load (up when under-loaded, down when over-loaded); 0: off."""
    capacity_factor: float | None = None
    """null: dropless. A number: each expert takes at most ceil(factor x tokens x top_k / num_experts) token
    assignments per micro batch; the rest are dropped (counted in moe/dropped_tokens)."""


def is_moe_block(moe: MoEConfig, index: int) -> bool:
    """Whether block `index` (0-based) holds experts rather than a dense MLP."""
    return moe.num_experts > 0 and (index + 1) % moe.every == 0


def num_moe_blocks(moe: MoEConfig, n_layer: int) -> int:
    """How many of `n_layer` blocks hold experts."""
    return sum(is_moe_block(moe, i) for i in range(n_layer))

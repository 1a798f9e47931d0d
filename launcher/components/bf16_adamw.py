"""AdamW for pure bf16 training (precision.param_dtype=bf16): bf16 weights and moments, no fp32 master copy.

Each step computes the update in fp32 from the bf16 weight, gradient and moments, then writes the new
weight and moments back to bf16 with stochastic rounding: a value between two bf16 neighbours becomes
the upper one with probability equal to its distance from the lower one, so the rounding is unbiased
and an update far below bf16's resolution (1/128 of the weight) still moves the weight in
expectation, where round-to-nearest would drop it every time (Zamirai et al., 2020, "Revisiting
BFloat16 Training"). torchao's `_AdamW(bf16_stochastic_round=True)` does the same, but it compiles a
kernel per parameter shape on first use (12 s on two CPU cores for gpt_tiny, again for every shard
shape under FSDP2) and draws its rounding bits from the global random state, which DDP replicas would
have to consume identically to stay equal. Here the bits come from a generator seeded by (train.seed,
step, parameter index): every replica rounds alike, a resumed run rounds as the uninterrupted one did
(nothing to checkpoint beyond the step count), and the moments are rounded stochastically too, so
the second moment keeps moving under beta2=0.999 (a 0.1% change is below bf16's resolution).
DTensor parameters (FSDP2 shards) are updated through their local tensors; their state stays DTensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.components.optimizer import param_groups
from launcher.config.optimizer import OptimizerConfig

LOW_BITS = 1 << 16
"""The 16 low bits of a float32 that bf16 drops."""
HIGH_MASK = -LOW_BITS
"""0xFFFF0000 as an int32: keeps sign, exponent and bf16's 7 mantissa bits."""


def round_stochastic_(out: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """Write fp32 `value` into bf16 `out`, rounding up or down at random in proportion to the distance (unbiased).

    `value` is used as scratch. Adding 16 random bits to the 16 bits bf16 drops carries into the kept ones
    with probability (dropped bits) / 2^16; inf keeps its bits (its dropped bits are zero) and nan stays nan.
    """
    bits = value.view(torch.int32)
    noise = torch.randint(0, LOW_BITS, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    out.copy_(bits.add_(noise).bitwise_and_(HIGH_MASK).view(torch.float32))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard, which shares its storage)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's formula) over bf16 parameters, stored in bf16 with stochastic rounding."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        seed: int,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        """The rounding bits' generator for parameter `index` at `step`: the same on every rank and after resume."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed((self.seed * 1_000_003 + step * 65_537 + index) % (1 << 63))
        return generator

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One AdamW step over every parameter with a gradient."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                self._update(p, group, state, index)

    def _update(self, p: torch.Tensor, group: dict, state: dict, index: int) -> None:
        """The fp32 update of one parameter, written back in its stored dtype."""
        weight, grad = _local(p), _local(p.grad)
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        step = int(state["step"])
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        g = grad.to(torch.float32)
        m = exp_avg.to(torch.float32).lerp_(g, 1 - beta1)
        v = exp_avg_sq.to(torch.float32).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        w = weight.to(torch.float32).mul_(1 - lr * group["weight_decay"])
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        w.addcdiv_(m, denom, value=-step_size)
        if weight.dtype != torch.bfloat16:  # an fp32 parameter: plain stores, torch's AdamW exactly
            weight.copy_(w), exp_avg.copy_(m), exp_avg_sq.copy_(v)
            return
        generator = self._generator(weight.device, step, index)
        for out, value in ((weight, w), (exp_avg, m), (exp_avg_sq, v)):
            round_stochastic_(out, value, generator)


def build_bf16_adamw(model: nn.Module, cfg: OptimizerConfig, seed: int) -> StochasticRoundingAdamW:
    """optimizer=adamw under precision.param_dtype=bf16: the same parameter groups and settings as torch's AdamW."""
    groups = param_groups(model.named_parameters(), cfg)
    return StochasticRoundingAdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, seed=seed
    )

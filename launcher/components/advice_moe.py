"""The advisor's rule over the MoE routing records: a router that sends (nearly) every token to the same experts.

It reads `moe_load/<block>` (the most loaded expert's assignments over the mean, per MoE block of the built-in
GPT, launcher.components.model.moe_balance, or per MoE layer of a Hugging Face folder,
launcher.components.model.hf_routing). A block whose router ignores the token sends every token to
the same `top_k` experts: each of them takes every token and the load reaches its ceiling, num_experts /
top_k; the other experts get no token and stop training. Pure Python, no torch, as the other rules
(launcher.components.advice_rules).
"""

from __future__ import annotations

import math
import re
from typing import Any

COLLAPSE_TOKEN_SHARE = 0.9
"""A block collapses when its most loaded expert takes at least this share of the tokens (load / ceiling):
balanced routing gives each expert top_k / num_experts of them, so only a router that ignores the token comes
near 1 (measured on a 2-block gpt_moe_tiny, micro batches of 128 tokens, one record per step: without
balancing it reaches 1.0 at step 7; with the preset's balancing it stays at or below 0.85 over 12 steps)."""
COLLAPSE_RECORDS = 3
"""Consecutive records at or above that share before the advisor speaks (one noisy log interval is no collapse)."""

BLOCK_FIX = (
    "the load-balancing loss (model.moe.aux_loss_coef=0.01, Switch/Mixtral) or loss-free balancing "
    "(model.moe.bias_update_rate=0.001, DeepSeek-V3; a much larger rate swings the bias and the load with it)"
)
"""The built-in GPT's balancing keys."""
FOLDER_FIX = (
    "the router's load-balancing loss, which a folder's config.json turns on (\"output_router_logits\": true, "
    '"router_aux_loss_coef": 0.01)'
)
"""A Hugging Face folder's balancing: its own config keys (launcher.rank.router_loss adds the loss)."""

_BLOCK = re.compile(r"moe_load/(\d+)$")


class RouterCollapse:
    """An MoE block's router sends nearly every token to the same experts, record after record."""

    id = "router_collapse"

    def __init__(self, *, load_ceiling: float, folder: bool = False) -> None:
        self.ceiling, self.folder = load_ceiling, folder
        """num_experts / top_k: the load when top_k experts take every token (0: no MoE blocks)."""
        self._streak: dict[int, int] = {}

    def check(self, record: dict[str, Any]) -> str | None:
        if self.ceiling <= 1:  # no MoE blocks, or top_k = num_experts: every expert takes every token
            return None
        collapsed: list[tuple[int, float]] = []
        for key, load in record.items():
            match = _BLOCK.match(key)
            if not match or not isinstance(load, int | float) or not math.isfinite(load):
                continue
            block = int(match.group(1))
            high = load >= COLLAPSE_TOKEN_SHARE * self.ceiling
            self._streak[block] = self._streak.get(block, 0) + 1 if high else 0
            if self._streak[block] >= COLLAPSE_RECORDS:
                collapsed.append((block, load))
        return self._message(record.get("step"), collapsed) if collapsed else None

    def _message(self, step: Any, collapsed: list[tuple[int, float]]) -> str:
        names = ", ".join(
            f"{b} ({load / self.ceiling:.0%} of the tokens, load {load:.2f})" for b, load in collapsed
        )
        return (
            f"the router of MoE block{'s' if len(collapsed) > 1 else ''} {names} sends nearly every token to the same "
            f"experts: for {COLLAPSE_RECORDS} records to step {step} the most loaded expert took at least "
            f"{COLLAPSE_TOKEN_SHARE:.0%} of the tokens (moe_load/<block> at or above {COLLAPSE_TOKEN_SHARE:g} x "
            f"{self.ceiling:g}, num_experts / top_k), so the other experts train on almost nothing. Balance the "
            f"routing: {FOLDER_FIX if self.folder else BLOCK_FIX}, and lower optimizer.lr (the router's logits "
            "outgrow the balancing); resume from a checkpoint saved before the collapse."
        )


def moe_rules(*, load_ceiling: float, folder: bool = False) -> list[Any]:
    """The MoE routing rules, in the order they are checked (`folder`: a Hugging Face folder's MoE layers)."""
    return [RouterCollapse(load_ceiling=load_ceiling, folder=folder)]

"""The objective seam: what a runner asks for a micro batch's loss, given the model's outputs and the batch.

An objective returns the SUM of its per-token (or per-example) losses and how many it counted, so
that accumulation and data parallelism normalize by the count of the whole optimizer step, however
a batch is split. It receives the whole batch dict (labels, and whatever else its data carries, e.g.
a preference pair's chosen and rejected halves) and the outputs of the model being trained; state
it keeps between calls (a frozen teacher or reference model, running sums) is its own. Runners and
strategies know nothing of which objective they serve. `metrics` adds keys to a log step's record.

Every objective is one module of this package, listed in `OBJECTIVES` (nothing registers itself):

- `cross_entropy`: summed token cross-entropy over labels != -100 (`launcher.components.model.loss.lm_loss`);
- `distillation`: cross-entropy mixed with a frozen teacher's KD term (objective=sft with distill.teacher);
- `on_policy`: the generalised JSD to a frozen teacher over the student's own samples (distill.mode=on_policy);
- `preference`: dpo, simpo, orpo and kto over pairs (or kto rows), dpo and kto against a reference;
- `policy_gradient`: grpo and rloo over rollouts the policy samples (launcher.rank.rollouts), a reference with beta > 0.

Each module has `frozen_model(objective, distill, *, adapters) -> FrozenModel | None`, the frozen model
it reads beside the policy declared as data, and `build(objective, distill, frozen) -> Objective`,
given that model placed (launcher.rank.objective places it like the student: no component places).

`count` says how many terms a batch adds to its optimizer step (trained tokens, or pairs): the loop
divides the step's summed loss by that count over every micro batch and data-parallel rank.

A pipeline's last stage asks the objective too, with a batch holding `labels` only (the stages
exchange hidden states, not batches): objectives that need more are refused there by the rules.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from launcher.config.distill import DistillConfig
from launcher.config.objective import ObjectiveConfig

if TYPE_CHECKING:  # torch only on a rank
    import torch

DataSum = Callable[[list[float]], list[float]]
"""Sums plain numbers over data-parallel groups, each counted once (DistContext.data_sum)."""
Frozen = Callable[..., "torch.Tensor"]
"""A placed frozen model, called as the policy is (`frozen(**model_inputs(batch))` -> logits) under no_grad."""

OBJECTIVES: dict[str, str] = {
    "sft": "cross_entropy",
    "dpo": "preference",
    "simpo": "preference",
    "orpo": "preference",
    "kto": "preference",
    "grpo": "policy_gradient",
    "rloo": "policy_gradient",
}
"""objective.name -> the module of this package that implements it (one entry per option of the group)."""
WITH_TEACHER = "distillation"
"""The module that trains objective=sft when distill.teacher is set (the rules refuse a teacher elsewhere)."""
ON_POLICY = "on_policy"
"""The module that trains objective=sft when distill.mode=on_policy (the student samples, the teacher scores)."""
SOURCES = ("teacher", "copy", "adapters_off")
"""Where a frozen model comes from: a teacher folder, a frozen copy of the initial policy, the policy's base."""


@dataclass(frozen=True, kw_only=True)
class FrozenModel:
    """The frozen model an objective reads beside the policy: declared here, placed by the rank."""

    source: str
    """teacher (read from `path`), copy (the initial policy, frozen) or adapters_off (the policy with LoRA off)."""
    path: str | None = None
    """source=teacher: the run directory (its spec.yaml and newest checkpoint) or Hugging Face folder."""
    precomputed: bool = False
    """Read once before training (every pair's log-probs, carried by the batches as `ref_logps`), then dropped."""


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The trained tokens of a batch (labels != -100)."""
    return int((batch["labels"] != -100).sum())


class Objective(Protocol):
    """The loss of a micro batch, as a sum and the number of terms it counts."""

    counts_processed_tokens: bool
    """Whether the record's tokens_per_s counts every token the model processed (both sides of a pair, the
    prompts a teacher reads too) rather than the trained ones (labels != -100), which trained_tokens_per_s counts."""

    def loss_sum(
        self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss in float32, counted terms) of `batch` given the model's `outputs` (call it under autocast).

        `train` is False on held-out batches: an objective may report a plainer loss there.
        """
        ...

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The terms `batch` adds to its step's count (its trained tokens, or a preference batch's pairs)."""
        ...

    def metrics(self, data_sum: DataSum) -> dict[str, float]:
        """Keys for the log step's record since the last call (summed over ranks with `data_sum`); {} for none."""
        ...


class ObjectiveModule(Protocol):
    """What each module of `OBJECTIVES` offers: its frozen model as data, and the objective built over it."""

    def frozen_model(
        self, objective: ObjectiveConfig, distill: DistillConfig, *, adapters: bool
    ) -> FrozenModel | None:
        """The frozen model this run's objective reads (`adapters`: the policy carries LoRA adapters), or None."""
        ...

    def build(self, objective: ObjectiveConfig, distill: DistillConfig, frozen: Frozen | None) -> Objective:
        """The objective, given its frozen model placed (None: it declared none, or reads it precomputed)."""
        ...


def module_name(objective: ObjectiveConfig, distill: DistillConfig) -> str:
    """The module of this package that trains the run: the group's entry, or distillation with a teacher."""
    name = OBJECTIVES[objective.name]
    if name != OBJECTIVES["sft"] or distill.teacher is None:
        return name
    return ON_POLICY if distill.on_policy else WITH_TEACHER


def objective_module(objective: ObjectiveConfig, distill: DistillConfig) -> ObjectiveModule:
    """The module that trains the run, imported on demand (the launching process needs none of them)."""
    module: ModuleType = importlib.import_module(f"{__name__}.{module_name(objective, distill)}")
    return module  # type: ignore[return-value]

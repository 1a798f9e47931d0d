"""Schema of the objective group: what the loop minimises, cross-entropy (sft), a preference loss or online RL.

What the group builds at run time lives in launcher.components.objectives (OBJECTIVES: a module per option).
"""

from __future__ import annotations

from dataclasses import dataclass

NAMES = ("sft", "dpo", "simpo", "orpo", "kto", "grpo", "rloo")
"""The objectives: supervised cross-entropy, the four preference losses, and online RL (grpo, rloo)."""
DPO_LOSSES = ("sigmoid", "ipo")
"""objective.loss under dpo: the DPO paper's sigmoid loss, or IPO's squared loss."""
REFERENCES = ("model", "precompute")
"""Where the reference log-probs come from: a frozen reference model each step, or computed once before training."""
PAIRED = ("dpo", "simpo", "orpo")
"""Objectives trained on data.format=preference (a chosen and a rejected response per prompt)."""
NEEDS_REFERENCE = ("dpo", "kto")
"""Objectives that compare the policy with a reference model (simpo and orpo need none)."""
ONLINE = ("grpo", "rloo")
"""Objectives trained on rollouts the policy samples from data.format=prompt (a reference only with beta > 0)."""
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""objective.loss_type under grpo, as TRL's GRPOTrainer names them: per-sequence mean, per-token over the
micro batch, per-token over a constant (rows x max_completion_length), per-token over the step."""
SCALE_REWARDS = ("group", "none")
"""objective.scale_rewards: divide each advantage by its group's reward std (group), or not (none: Dr. GRPO)."""


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """The training objective: sft (cross-entropy) or a preference loss with its coefficients."""

    name: str = "sft"
    """sft (cross-entropy), dpo, simpo, orpo (data.format=preference), kto (data.format=kto), grpo or rloo (data.format=prompt)."""
    beta: float = 0.1
    """dpo/kto: scale of the log-ratio to the reference; simpo: reward scale; orpo: weight of the odds-ratio term (> 0);
    grpo, rloo: weight of the KL to the reference (0: no reference)."""
    loss: str = "sigmoid"
    """dpo only: sigmoid (the DPO loss) or ipo (IPO's squared loss on length-averaged log-ratios)."""
    label_smoothing: float = 0.0
    """dpo and simpo: the assumed share of flipped labels in [0, 0.5) (conservative DPO)."""
    gamma: float = 0.5
    """simpo: the target reward margin gamma (the loss uses gamma / beta on the length-normalised log-probs)."""
    desirable_weight: float = 1.0
    """kto: weight of the desirable (label true) examples' loss."""
    undesirable_weight: float = 1.0
    """kto: weight of the undesirable (label false) examples' loss."""
    reference: str = "model"
    """dpo and kto: model (a reference forward each step; with LoRA the base with adapters off) or precompute (once, cached)."""
    num_generations: int = 8
    """grpo, rloo: completions sampled per prompt (a group; at least 2); train.micro_batch_size counts completions."""
    max_completion_length: int = 64
    """grpo, rloo: new tokens a completion may have at most (the prompt plus this must fit data.seq_len)."""
    temperature: float = 1.0
    """grpo, rloo: sampling temperature of the rollouts (> 0); the loss's log-probs are of logits / temperature (TRL)."""
    top_p: float = 1.0
    """grpo, rloo: sample from the smallest set of most likely tokens whose probability reaches top_p."""
    top_k: int = 0
    """grpo, rloo: sample among the k most likely tokens only (0: no limit)."""
    scale_rewards: str = "group"
    """grpo: group (advantages divided by the group's reward std) or none (Dr. GRPO: the centred rewards)."""
    normalize_advantages: bool = False
    """rloo: standardise the leave-one-out advantages over this rank's rollouts of the step (TRL's normalize_advantages)."""
    loss_type: str = "dapo"
    """grpo: how token losses are summed: grpo (per sequence), bnpo (per micro batch), dr_grpo (constant), dapo (per step)."""
    epsilon: float = 0.2
    """grpo, rloo: the importance ratio is clipped below at 1 - epsilon."""
    epsilon_high: float | None = None
    """grpo, rloo: the ratio is clipped above at 1 + epsilon_high (DAPO's clip-higher: 0.28); null: epsilon."""
    num_iterations: int = 1
    """grpo, rloo: optimizer steps on each rollout batch (ratios against the sampling policy's log-probs)."""
    mask_truncated_completions: bool = False
    """grpo, rloo: completions cut at max_completion_length train nothing (DAPO's overlong filtering)."""
    overlong_buffer: int = 0
    """grpo, rloo: soft overlong penalty: completions longer than max_completion_length - overlong_buffer lose reward
    linearly, up to overlong_penalty at the limit (DAPO); 0: none."""
    overlong_penalty: float = 1.0
    """grpo, rloo: the reward a completion at max_completion_length loses with overlong_buffer > 0."""
    drop_equal_groups: bool = False
    """grpo, rloo: groups whose rewards are all equal (no learning signal) are left out of the loss and its count."""
    log_rollouts: int = 0
    """grpo, rloo: rollouts per step written to rollouts.jsonl in the run directory (prompt, completion, reward)."""


def rows_per_example(name: str) -> int:
    """Rows a micro batch holds per example: 2 for a pair (chosen and rejected) or a kto example (and its KL row), else 1."""
    return 2 if name in PAIRED or name == "kto" else 1

"""Schema of the optimizer group, and which of its keys each optimizer option reads.

What the group builds at run time lives in launcher.components.optimizer. Every optimizer.* key
either reaches the optimizer an option builds or, set on purpose for an option that does not
read it, is refused before launch (launcher.rules.optimizer.unread_keys): READS is that table.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Which optimizer updates the weights, and its hyper-parameters."""

    name: str = "adamw"
    """An option of the optimizer group (see OPTIMIZERS)."""
    lr: float = 1e-3
    """Peak learning rate (the scheduler scales it per step)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only unless decay_norms_and_biases."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam-family moment coefficients."""
    eps: float = 1e-8
    """Denominator epsilon: the Adam family's eps, Adafactor's eps[0] (the floor of its second moments)."""
    momentum: float = 0.9
    """SGD momentum; Muon's momentum (muon.yaml: 0.95)."""
    nesterov: bool = False
    """Nesterov momentum (SGD; Muon, where muon.yaml turns it on)."""
    decay_norms_and_biases: bool = False
    """Apply weight decay to norm weights and biases as well (usually worse)."""
    beta2_decay: float = -0.8
    """Adafactor: exponent of its second-moment decay, beta2 at step t = 1 - t ** beta2_decay."""
    eps2: float = 1e-3
    """Adafactor: least parameter RMS its relative step is scaled by (torch's eps[1]; optimizer.eps is eps[0])."""
    clip_threshold: float = 1.0
    """Adafactor: an update whose RMS exceeds this is scaled down to it (torch's d)."""
    implementation: str = "auto"
    """torch kernel choice: auto (fused AdamW on CUDA and CPU, fused SGD on CUDA, foreach otherwise),
    fused, foreach or for_loop."""
    # read by muon
    muon_exclude: list[str] = field(default_factory=lambda: list(MUON_EXCLUDE))
    """Parameter-name patterns (fnmatch) that AdamW updates instead of Muon; 1-D tensors always go to AdamW."""
    ns_steps: int = 5
    """Muon's Newton-Schulz iterations per step (torch's default 5)."""
    adjust_lr_fn: str = "match_rms_adamw"
    """Muon's per-matrix lr scale: match_rms_adamw (0.2 sqrt(max(A, B)), AdamW's lr works) or original."""
    adamw_lr: float | None = None
    """Learning rate of Muon's AdamW part (embeddings, head, norms, biases); null: optimizer.lr."""


MUON_EXCLUDE = ("*emb*", "*wte*", "*wpe*", "*lm_head*")
"""Embeddings and output heads of the GPT family (tok_emb, pos_emb, lm_head) and of Hugging Face families
(embed_tokens, wte, wpe, embed_in, embed_out, word_embeddings, lm_head): AdamW, not Muon."""

ADJUST_LR_FNS = ("match_rms_adamw", "original")
"""torch.optim.Muon's adjust_lr_fn options."""


FUSED_AUTO_DEVICES = {"adamw": ("cuda", "cpu"), "sgd": ("cuda",)}
"""Where `implementation=auto` picks torch's fused kernel, per optimizer. AdamW's CPU kernel (torch >= 2.4,
float32/64, bfloat16 and float16, plain tensors and DTensors) is one vectorized pass over each
tensor, where foreach launches several ops per tensor list; Hugging Face Trainer picks it too."""


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "lion_8bit")
"""The options whose state bitsandbytes keeps in 8 bits (block-wise quantized)."""


SHARED_KEYS = ("name", "lr", "weight_decay", "decay_norms_and_biases")
"""The optimizer.* keys every option reads: its name and the parameter groups (lr, weight decay per group)."""

READS: dict[str, tuple[str, ...]] = {
    "adamw": ("betas", "eps", "implementation"),
    "sgd": ("momentum", "nesterov", "implementation"),
    "adamw_8bit": ("betas", "eps"),
    "paged_adamw_8bit": ("betas", "eps"),
    "lion_8bit": ("betas",),
    "adafactor": ("eps", "eps2", "beta2_decay", "clip_threshold", "implementation"),
    "muon": (
        "betas",
        "eps",
        "implementation",
        "momentum",
        "nesterov",
        "muon_exclude",
        "ns_steps",
        "adjust_lr_fn",
        "adamw_lr",
    ),  # fmt: skip
    "adamw_schedule_free": ("betas", "eps", "implementation"),
}
"""One row per optimizer option: the keys its builder passes on besides SHARED_KEYS. A key outside its row,
set on the command line, in a recipe or in a chosen option's file, is refused before launch."""


def reads(name: str) -> tuple[str, ...]:
    """Every optimizer.* key the option `name` reads (SHARED_KEYS and its row of READS)."""
    return (*SHARED_KEYS, *READS.get(name, ()))

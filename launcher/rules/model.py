"""Rules of the model group's numbers: every dimension a positive count, dropout a probability, whole heads.

A zero or negative dimension, or a dropout of 2, composes and types fine, and used to fail in a
rank's build (nn.Dropout, nn.Linear) after the run directory was made. A Hugging Face folder's
config.json decides its dimensions (launcher.front.model_dims fills them in), so those are judged
by rules/hf_model.py against its weights, not here.
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.components.model.hf_files import local_dir
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

DIMENSIONS = {
    "n_layer": ("transformer blocks", "model.n_layer=4"),
    "n_head": ("attention heads", "model.n_head=4"),
    "d_model": ("the residual stream's width", "model.d_model=128"),
    "d_ff": ("the MLP's hidden width", "model.d_ff=null (4 * d_model)"),
    "max_seq_len": ("positions the model holds", "model.max_seq_len=256 (at least data.seq_len)"),
}
"""Each dimension of the model group: what it counts, and a fix to suggest."""
ROTARY_PRESETS = ("llama",)
"""Presets with rotary position embeddings, which rotate pairs of each head's channels."""


def _dimensions(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m = spec.model
    if local_dir(m) is not None:
        return  # the folder's config.json decides these (rules/hf_model.py)
    for key, (what, example) in DIMENSIONS.items():
        value = getattr(m, key)
        if value is not None and value < 1:
            yield SpecError(
                (f"model.{key}",), f"counts {what}, so it must be 1 or more, got {value}. E.g. {example}."
            )
    if m.n_head >= 1 and m.d_model >= 1 and m.d_model % m.n_head:
        yield SpecError(
            ("model.d_model", "model.n_head"),
            f"d_model ({m.d_model}) must be a multiple of n_head ({m.n_head}): each head gets d_model / n_head "
            f"channels. E.g. model.n_head={_divisor_near(m.d_model, m.n_head)}.",
        )
    elif m.kind == "hf" and m.hf_config in ROTARY_PRESETS and m.n_head >= 1 and (m.d_model // m.n_head) % 2:
        yield SpecError(
            ("model.d_model", "model.n_head"),
            f"the {m.hf_config} preset rotates pairs of channels in each head, so d_model / n_head "
            f"({m.d_model} / {m.n_head} = {m.d_model // m.n_head}) must be even. Change model.n_head or model.d_model.",
        )


def _divisor_near(d_model: int, n_head: int) -> int:
    """The divisor of d_model closest to n_head (the fix to suggest)."""
    near = range(max(1, n_head - 64), min(d_model, n_head + 64) + 1)
    return min((h for h in near if d_model % h == 0), key=lambda h: (abs(h - n_head), h), default=1)


def _dropout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    dropout = spec.model.dropout
    if not 0.0 <= dropout < 1.0:
        yield SpecError(
            ("model.dropout",),
            f"is the probability of zeroing an activation, so it must lie in [0, 1), got {dropout}. "
            "E.g. model.dropout=0.1 (0.0: no dropout).",
        )


RULES: tuple[Rule, ...] = (_dimensions, _dropout)
"""This module's rules, in the order they report."""

"""Rules of the prune group (gradual magnitude and 2:4 pruning), checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.prune import GROUP_2_4, METHODS, SCOPES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

SUPPORTED_STRATEGIES = ("single", "ddp")
"""Strategies whose ranks hold every pruned weight whole, where the masks are computed and applied."""


def _values(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.prune
    if p.method not in METHODS:
        hint = (
            " (Hydra reads an unquoted 2_4 as the number 24: use prune=semi_2_4)" if p.method == "24" else ""
        )
        yield SpecError(("prune.method",), f"must be one of {', '.join(METHODS)}, got {p.method!r}{hint}.")
        return
    if p.method == "none":
        return
    if p.scope not in SCOPES:
        yield SpecError(("prune.scope",), f"must be one of {', '.join(SCOPES)}, got {p.scope!r}.")
    if not 0.0 <= p.target_sparsity < 1.0:
        yield SpecError(
            ("prune.target_sparsity",),
            f"must lie in [0, 1) (the share of the blocks' linear weights pruned at the end), got "
            f"{p.target_sparsity}. Use e.g. prune.target_sparsity=0.5.",
        )
    elif p.method == "2_4" and p.target_sparsity != 0.5:
        yield SpecError(
            ("prune.target_sparsity", "prune.method"),
            f"2:4 sparsity keeps 2 of every 4 weights, so its sparsity is 0.5 by construction, got "
            f"{p.target_sparsity}. Set prune.target_sparsity=0.5, or use prune=magnitude for another sparsity.",
        )
    yield from _schedule(spec)


def _schedule(spec: RunSpec) -> Iterator[SpecError]:
    p, max_steps = spec.prune, spec.train.max_steps
    if p.every <= 0:
        yield SpecError(
            ("prune.every",), f"must be 1 or more (optimizer steps between mask updates), got {p.every}."
        )
    if p.start_step < 0:
        yield SpecError(("prune.start_step",), f"must be 0 or more, got {p.start_step}.")
    if p.start_step >= p.end_step:
        yield SpecError(
            ("prune.start_step", "prune.end_step"),
            f"the schedule must start before it ends: start_step={p.start_step} >= end_step={p.end_step}. "
            "Set prune.end_step above prune.start_step.",
        )
    if p.end_step > max_steps:
        yield SpecError(
            ("prune.end_step", "train.max_steps"),
            f"prune.end_step={p.end_step} lies beyond train.max_steps={max_steps}: the run would end before "
            f"reaching prune.target_sparsity. Set prune.end_step={max_steps} or less (leaving steps after it "
            "lets the pruned model recover), or train longer.",
        )


def _base(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, q, par = spec.prune, spec.quantization, spec.parallel
    if p.method == "none":
        return
    if q.method != "none":
        yield SpecError(
            ("prune.method", "quantization.method"),
            f"pruning zeroes weights by their magnitude and keeps training the rest, but {q.method} weights are "
            "frozen integers (bitsandbytes) that neither train nor hold a mask. Prune a full-precision model "
            "(quantization=none) and quantize its exported weights afterwards.",
        )
    elif q.lora.rank > 0:
        yield SpecError(
            ("prune.method", "quantization.lora.rank"),
            "LoRA adds a dense low-rank update to each pruned weight, so the merged weights would not be sparse. "
            "Prune with full training (quantization=none, the default), or drop prune.",
        )
    if par.strategy not in SUPPORTED_STRATEGIES or par.tp_size > 1 or par.pp_size > 1:
        yield SpecError(
            ("prune.method", "parallel.strategy"),
            f"pruning is supported under {' and '.join(SUPPORTED_STRATEGIES)}, where every rank holds each pruned "
            f"weight whole (no pipeline stages). parallel.strategy={par.strategy} (pp_size {par.pp_size}) shards, splits or partitions them (a global "
            "magnitude threshold would need the full tensors on every update, and DeepSpeed's fp32 master "
            "weights would bring pruned weights back). Use parallel=ddp (the model fits on one device), or "
            "train dense and prune later.",
        )
    yield from _shapes(spec)


def _shapes(spec: RunSpec) -> Iterator[SpecError]:
    """2:4 needs every pruned layer's input features in whole groups of 4."""
    if spec.prune.method != "2_4":
        return
    from launcher.components.model.shape import model_shape

    try:
        linears = model_shape(spec.model).block_linears
    except (OSError, ValueError, KeyError):
        return  # launcher.rules.hf_model says what is wrong with the model folder
    bad = [f"{name} ({fan_in} in-features)" for name, (fan_in, _) in linears.items() if fan_in % GROUP_2_4]
    if bad:
        yield SpecError(
            ("prune.method", "model.d_model", "model.d_ff"),
            f"2:4 sparsity prunes 2 of every {GROUP_2_4} consecutive weights along the input dimension, so "
            f"each layer's in-features must be a multiple of {GROUP_2_4}: {', '.join(bad[:3])}. Use a "
            f"model.d_model and model.d_ff that are multiples of {GROUP_2_4}, or prune=magnitude.",
        )


RULES: tuple[Rule, ...] = (_values, _base)
"""This module's rules, in the order they report."""

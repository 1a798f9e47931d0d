"""Rules of the precision group: one autocast dtype, and only what the device supports."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.groups.precision import DTYPES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError


def _precision(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.precision
    if p.fp16 and p.bf16:
        yield SpecError(
            ("precision.fp16", "precision.bf16"),
            "fp16 and bf16 are both on, but a run autocasts to one dtype. Choose one: "
            "`precision=bf16` (preferred where the hardware has it) or `precision=fp16`.",
        )
    if p.bf16 and not hw.bf16:
        yield SpecError(
            ("precision.bf16",),
            f"this {hw.device_type} device has no bf16 support (CUDA needs compute capability 8.0+). "
            "Use `precision=fp16` (loss-scaled) or `precision=fp32`.",
        )
    if p.tf32 and not hw.tf32:
        yield SpecError(
            ("precision.tf32",),
            f"TF32 exists only on NVIDIA GPUs of compute capability 8.0 or newer, and this run is on "
            f"{hw.device_type}. Use `precision=fp32` (or `precision=bf16`) here.",
        )
    if p.eval_dtype is not None and p.eval_dtype not in DTYPES:
        yield from choice("precision.eval_dtype", p.eval_dtype, tuple(DTYPES), "dtype")
    if p.fp16 and p.loss_scale_init <= 0:
        yield SpecError(("precision.loss_scale_init",), "the fp16 loss scale must be positive, e.g. 65536.")


RULES: tuple[Rule, ...] = (_precision,)
"""This module's rules, in the order they report."""

"""Rules of the precision group: one autocast dtype, and only what the device supports."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.precision import DTYPES, FP8_MIN_CAPABILITY, FP8_RECIPES
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
    # no GPU here (hw.missing_gpu): rules/launch.py refuses launcher.device=cuda; no device to judge
    if p.bf16 and not hw.bf16 and not hw.missing_gpu:
        yield SpecError(
            ("precision.bf16",),
            f"this {hw.device_type} device has no bf16 support (CUDA needs compute capability 8.0+). "
            "Use `precision=fp16` (loss-scaled) or `precision=fp32`.",
        )
    if p.tf32 and not hw.tf32 and not hw.missing_gpu:
        yield SpecError(
            ("precision.tf32",),
            f"TF32 exists only on NVIDIA GPUs of compute capability 8.0 or newer, and this run is on "
            f"{hw.device_type}. Use `precision=fp32` (or `precision=bf16`) here.",
        )
    if p.eval_dtype is not None and p.eval_dtype not in DTYPES:
        yield from choice("precision.eval_dtype", p.eval_dtype, tuple(DTYPES), "dtype")
    if p.fp16 and p.loss_scale_init <= 0:
        yield SpecError(("precision.loss_scale_init",), "the fp16 loss scale must be positive, e.g. 65536.")


def _fp8(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.precision
    if not p.fp8:
        return
    if p.fp8_recipe not in FP8_RECIPES:
        yield from choice("precision.fp8_recipe", p.fp8_recipe, FP8_RECIPES, "fp8 scaling recipe")
    if not p.bf16 or p.fp16:
        yield SpecError(
            ("precision.fp8", "precision.bf16"),
            "fp8 training runs its linear layers in float8 and everything else under bf16 autocast, so it "
            "needs precision.bf16=true and precision.fp16=false. Use `precision=fp8`, which sets both.",
        )
    if not hw.fp8 and not hw.missing_gpu:
        major, minor = FP8_MIN_CAPABILITY
        where = (
            f"a GPU of compute capability {hw.capability[0]}.{hw.capability[1]}"
            if hw.device_type == "cuda"
            else "the CPU"
        )
        yield SpecError(
            ("precision.fp8",),
            f"fp8 matmuls need an NVIDIA GPU of compute capability {major}.{minor} or newer (H100, H200, L4, "
            f"RTX 4090), and this run is on {where}. Use `precision=bf16` here (bf16 autocast, the same "
            "numbers fp8 is compared against), or run on such a GPU with launcher.device=cuda.",
        )
    if spec.quantization.method != "none":
        yield SpecError(
            ("precision.fp8", "quantization.method"),
            f"fp8 training swaps full-precision linear layers for float8 ones, and quantization.method="
            f"{spec.quantization.method} has already made them int8/nf4 layers. Use `precision=bf16` with a "
            "quantized base, or `quantization=none` with fp8.",
        )


RULES: tuple[Rule, ...] = (_precision, _fp8)
"""This module's rules, in the order they report."""

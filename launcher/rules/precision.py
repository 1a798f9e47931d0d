"""Rules of the precision group: one autocast dtype, only what the device supports, pure bf16 where it composes."""

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


PURE_BF16_STRATEGIES = ("single", "ddp", "fsdp")
"""Strategies whose optimizer step pure bf16 replaces (the torch-native ones without TP, CP or pipeline stages)."""


def _pure_bf16(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, o, par = spec.precision, spec.optimizer, spec.parallel
    if p.param_dtype != "bf16":
        return
    fix = "or keep fp32 master weights with `precision=bf16` (precision.param_dtype=fp32)"
    if not p.bf16 or p.fp16:
        yield SpecError(
            ("precision.param_dtype", "precision.bf16"),
            "precision.param_dtype=bf16 runs the forward under bf16 autocast (which keeps softmax, norms and "
            "the loss in fp32), so it needs precision.bf16=true and precision.fp16=false. Use "
            "`precision=pure_bf16`, which sets all three.",
        )
    if p.fp8:
        yield SpecError(
            ("precision.param_dtype", "precision.fp8"),
            "pure bf16 and fp8 training both replace how the linear layers store their weights. Use one: "
            "`precision=pure_bf16` or `precision=fp8`.",
        )
    if o.name != "adamw" or o.implementation != "auto":
        yield SpecError(
            ("precision.param_dtype", "optimizer.name", "optimizer.implementation"),
            f"pure bf16 steps with its own AdamW (bf16 moments, stochastic rounding), so it needs "
            f"optimizer=adamw with optimizer.implementation=auto, and this run has optimizer={o.name}, "
            f"implementation={o.implementation} (torch's fused/foreach kernels would round to nearest and "
            f"drop small updates). Use `optimizer=adamw`, {fix}.",
        )
    wrong = par.strategy not in PURE_BF16_STRATEGIES or max(par.tp_size, par.pp_size, par.cp_size) > 1
    if wrong:
        yield SpecError(
            ("precision.param_dtype", "parallel.strategy"),
            f"pure bf16 runs under parallel=single, ddp or fsdp (without tensor, context or pipeline "
            f"parallelism), and this run has parallel.strategy={par.strategy}, tp_size={par.tp_size}, "
            f"cp_size={par.cp_size}, pp_size={par.pp_size}. DeepSpeed keeps bf16 weights by itself with "
            f"precision=bf16 (its fp32 master copy lives in the optimizer). Use one of those strategies, {fix}.",
        )
    quantized = spec.quantization.method != "none" or spec.quantization.lora.rank > 0
    if quantized or spec.qat.scheme != "none":
        yield SpecError(
            ("precision.param_dtype", "quantization.method", "qat.scheme"),
            "pure bf16 stores every trainable weight in bf16, and quantized bases, LoRA adapters and QAT "
            "keep their own dtypes. Use `quantization=none qat=none` with pure bf16, "
            f"{fix}.",
        )


def _dtype_name(spec: RunSpec, *, stored: bool) -> str:
    """torch's name of the dtype evaluation autocasts to (stored=False) or the weights are stored in."""
    p = spec.precision
    if stored:
        return "bfloat16" if p.param_dtype == "bf16" else "float32"
    return p.eval_dtype or ("bfloat16" if p.bf16 else "float16" if p.fp16 else "float32")


def _eval_cast(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, par = spec.precision, spec.parallel
    if not p.eval_cast:
        return
    target, stored = _dtype_name(spec, stored=False), _dtype_name(spec, stored=True)
    if target == stored:
        yield SpecError(
            ("precision.eval_cast", "precision.eval_dtype"),
            f"precision.eval_cast=true casts the weights to the eval dtype for evaluation, but that is "
            f"{target}, the dtype they are stored in: there is nothing to cast. Name another one, e.g. "
            f"`precision.eval_dtype=bfloat16`, or drop precision.eval_cast.",
        )
    if par.strategy not in ("single", "ddp") or max(par.tp_size, par.pp_size, par.cp_size) > 1:
        yield SpecError(
            ("precision.eval_cast", "parallel.strategy"),
            f"precision.eval_cast casts a whole model's weights, and parallel.strategy={par.strategy} holds "
            f"them sharded (under fsdp and deepspeed with precision=bf16 evaluation already runs on bf16 "
            f"weights: FSDP2 gathers them in bf16, DeepSpeed stores them so). Use parallel=single or ddp, "
            f"or drop precision.eval_cast.",
        )


RULES: tuple[Rule, ...] = (_precision, _fp8, _pure_bf16, _eval_cast)
"""This module's rules, in the order they report."""

"""Rules of the qat group (torchao quantization-aware training), checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.model import ff_width
from launcher.config.qat import SCHEMES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError

QAT_STRATEGIES = ("single", "ddp", "fsdp")
"""Strategies QAT is tested under (tests/integration/test_qat.py); the others split or wrap Linear layers
in ways torchao's FakeQuantizedLinear was not checked with."""


def _scheme(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q = spec.qat
    yield from choice("qat.scheme", q.scheme, SCHEMES, "QAT scheme")
    if q.scheme == "none":
        return
    if q.group_size <= 0:
        yield SpecError(("qat.group_size",), f"must be positive (32 is common), got {q.group_size}.")
    if not 0 <= q.start_step < spec.train.max_steps:
        yield SpecError(
            ("qat.start_step", "train.max_steps"),
            f"fake quantization would start at step {q.start_step}, but the run has steps 0 to "
            f"{spec.train.max_steps - 1}: it would never train quantization-aware. Choose a qat.start_step in "
            f"[0, {spec.train.max_steps}) (e.g. a tenth of the run), or raise train.max_steps.",
        )


def _group_size(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q, m = spec.qat, spec.model
    if q.scheme == "none" or q.group_size <= 0 or m.kind != "gpt":
        return  # a Hugging Face model's widths are checked when the rank builds it (same message)
    widths = sorted({m.d_model, ff_width(m)})
    bad = [w for w in widths if w % q.group_size]
    if bad:
        divisors = [g for g in (32, 64, 128, 16, 256, 8) if all(w % g == 0 for w in widths)]
        yield SpecError(
            ("qat.group_size", "model.d_model"),
            f"int4 weights get one scale per {q.group_size} inputs, but the blocks' linear layers have "
            f"in-features {', '.join(map(str, widths))}, and {', '.join(map(str, bad))} "
            f"{'is' if len(bad) == 1 else 'are'} not a multiple of {q.group_size}. Choose a qat.group_size that "
            f"divides them{f' (e.g. {divisors[0]})' if divisors else ''}.",
        )


def _base(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q, quant = spec.qat, spec.quantization
    if q.scheme == "none":
        return
    if quant.method != "none":
        yield SpecError(
            ("qat.scheme", "quantization.method"),
            f"QAT trains float weights under fake quantization, but quantization.method={quant.method} stores them "
            "already quantized and frozen: there is nothing for QAT to train. Use `quantization=none` with QAT "
            "(its export, `train-export --qat-convert`, gives the quantized model), or drop QAT (`qat=none`).",
        )
    if quant.lora.rank > 0:
        yield SpecError(
            ("qat.scheme", "quantization.lora.rank"),
            "QAT with LoRA adapters is not supported: peft would wrap torchao's fake-quantized layers, which was not "
            "checked. Set quantization.lora.rank=0 (full training under QAT) or `qat=none`.",
        )
    if spec.precision.fp8:
        yield SpecError(
            ("qat.scheme", "precision.fp8"),
            "QAT and fp8 training both replace the blocks' linear layers (torchao FakeQuantizedLinear vs "
            "Float8Linear); one layer cannot be both. Train with one of them: drop precision.fp8 or use `qat=none`.",
        )
    p = spec.parallel
    if p.strategy not in QAT_STRATEGIES or p.tp_size > 1 or p.pp_size > 1:
        yield SpecError(
            ("qat.scheme", "parallel.strategy"),
            f"QAT runs under parallel={', '.join(QAT_STRATEGIES)} (tensor parallelism, pipelines and DeepSpeed "
            "would split or wrap the fake-quantized layers in untested ways). Use `parallel=ddp` or "
            "`parallel=fsdp` with tp_size=1 and pp_size=1, or `qat=none`.",
        )


RULES: tuple[Rule, ...] = (_scheme, _group_size, _base)
"""This module's rules, in the order they report."""

"""The step's compute time as the sum of its operators, each at the rate its kernel achieves on a part.

An operator of the simulated step (launcher/rank/op_count: its FLOPs and the bytes it reads and
writes, from the fake tensors' shapes and dtypes) takes max(FLOPs / the achievable rate of its kind
and shape, bytes / the achievable bandwidth) plus one kernel boundary: matmuls and attention are
compute-bound at their calibrated rates, copies, elementwise ops, norms and the optimizer are
bandwidth-bound. The GPU's time is the sum; eager mode's CPU issues each kernel in turn, so a step
also takes at least (kernels x the CPU's issue time) and the step's compute is the larger of the
two. The achievable rates of Hopper parts (H100, H200: one SM design) come from one measured H200
(launcher/plan/calibration_h200.py, by scripts/calibrate_roofline), GEMM and attention FLOP/s
scaled by each part's dense bf16 peak and bandwidth-bound rates as fractions of its HBM peak;
other parts use stated defaults. Nothing is fitted to an end-to-end run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from launcher.plan import calibration_h200 as h200
from launcher.plan.roofline import HARDWARE, Hardware

H200_BF16_FLOPS = HARDWARE["h200"].bf16_flops
H200_HBM_BYTES_PER_S = HARDWARE["h200"].hbm_bytes_per_s


class Op(Protocol):
    """One tallied operator (launcher.rank.op_count.OpTally has these fields)."""

    kind: str
    flops: float
    num_bytes: int
    count: int
    shape: tuple[int, ...]
    layout: str


@dataclass(frozen=True, kw_only=True)
class Achievable:
    """What kernels reach on one part, as fractions of its datasheet peaks (and the measured GEMM grid)."""

    gemm: tuple[tuple[int, int, int, str, float], ...] = ()
    """(M, N, K, layout, fraction of the bf16 peak) measured; empty: `gemm_fraction` for every shape."""
    gemm_fraction: float = 0.70
    """A GEMM's fraction of the dense bf16 peak where no grid is measured."""
    attention: tuple[tuple[int, int, int, float, float], ...] = ()
    """(batch x heads, seq, head_dim, forward fraction, backward fraction) measured; empty: the two below."""
    attention_forward_fraction: float = 0.55
    attention_backward_fraction: float = 0.45
    elementwise_fraction: float = 0.80
    """Copies, elementwise ops, casts, the optimizer: fraction of the HBM peak."""
    norm_fraction: float = 0.55
    """LayerNorm / RMSNorm forward and backward: fraction of the HBM peak."""
    kernel_gap_s: float = 2e-6
    """GPU time of one kernel boundary."""
    cpu_issue_s: float = 10e-6
    """CPU time to issue one kernel in eager mode."""
    source: str = "defaults (not measured on this part)"
    """Where the numbers come from."""


def _hopper() -> Achievable:
    """The measured H200 as fractions of its datasheet peaks (Hopper parts share them)."""
    return Achievable(
        gemm=tuple((m, n, k, lay, rate / H200_BF16_FLOPS) for m, n, k, lay, rate in h200.GEMM_FLOPS),
        attention=tuple(
            (bh, s, d, fwd / H200_BF16_FLOPS, bwd / H200_BF16_FLOPS)
            for bh, s, d, fwd, bwd in h200.ATTENTION_FLOPS
        ),
        elementwise_fraction=h200.ELEMENTWISE_BYTES_PER_S / H200_HBM_BYTES_PER_S,
        norm_fraction=h200.NORM_BYTES_PER_S / H200_HBM_BYTES_PER_S,
        kernel_gap_s=h200.KERNEL_GAP_S,
        cpu_issue_s=h200.CPU_ISSUE_S,
        source=f"measured on one {h200.DEVICE}, {h200.DATE}, torch {h200.TORCH} (scripts/calibrate_roofline)",
    )


ACHIEVABLE: dict[str, Achievable] = {
    "h100_sxm": _hopper(),
    "h100_hbm2e": _hopper(),
    "h200": _hopper(),
    "a100_80g": Achievable(),
}
"""Achievable rates by hardware profile name (the keys of roofline.HARDWARE)."""


@dataclass(frozen=True, kw_only=True)
class Compute:
    """A rank's compute for one step, summed over its operators."""

    gpu_s: float
    """Every kernel at its achievable rate, plus a boundary each."""
    cpu_s: float
    """Every kernel issued by eager mode's CPU."""
    num_kernels: int
    """Kernels per step."""
    by_kind_s: dict[str, float] = field(default_factory=dict)
    """GPU seconds by kind: matmul, attention, memory-bound (memory and norm), kernel boundaries."""

    @property
    def step_s(self) -> float:
        """The compute of the step: the GPU's time, or the CPU's where issuing kernels takes longer."""
        return max(self.gpu_s, self.cpu_s)


def _nearest(rows: Iterable[tuple], key: tuple[float, ...], layout: str = "") -> tuple:
    """The measured row closest in log-shape (a different operand layout counts as a quarter octave)."""

    def distance(row: tuple) -> float:
        shape = sum(math.log2(max(a, 1) / max(b, 1)) ** 2 for a, b in zip(row[: len(key)], key, strict=True))
        return shape + (0.0625 if layout and row[len(key)] != layout else 0.0)

    return min(rows, key=distance)


def gemm_flops_per_s(shape: tuple[int, ...], layout: str, hw: Hardware, ach: Achievable) -> float:
    """The achievable FLOP/s of a GEMM of this (M, N, K) and layout on `hw`."""
    if not ach.gemm or len(shape) != 3:
        return ach.gemm_fraction * hw.bf16_flops
    return _nearest(ach.gemm, shape, layout)[4] * hw.bf16_flops


def attention_flops_per_s(op: Op, hw: Hardware, ach: Achievable) -> float:
    """The achievable FLOP/s of a fused attention forward or backward on `hw` (nearest measured shape)."""
    backward = op.kind == "attention_backward"
    if not ach.attention or len(op.shape) != 3:
        fraction = ach.attention_backward_fraction if backward else ach.attention_forward_fraction
        return fraction * hw.bf16_flops
    row = _nearest(ach.attention, op.shape)
    return (row[4] if backward else row[3]) * hw.bf16_flops


def op_seconds(op: Op, hw: Hardware, ach: Achievable) -> float:
    """One call of `op` on `hw`: max(FLOPs at its rate, bytes at its bandwidth) plus one kernel boundary."""
    if op.kind == "matmul":
        flops_s = op.flops / gemm_flops_per_s(op.shape, op.layout, hw, ach)
    elif op.kind.startswith("attention"):
        flops = op.flops * (2.0 if op.kind == "attention_backward" else 1.0)
        flops_s = flops / attention_flops_per_s(op, hw, ach)
    else:
        flops_s = 0.0
    fraction = ach.norm_fraction if op.kind == "norm" else ach.elementwise_fraction
    bytes_s = op.num_bytes / (fraction * hw.hbm_bytes_per_s)
    return max(flops_s, bytes_s) + ach.kernel_gap_s


def step_compute(ops: Iterable[Op], hw: Hardware, ach: Achievable) -> Compute:
    """The step's compute on `hw`: the sum over its operators (GPU) against eager mode's issue time (CPU)."""
    by_kind: dict[str, float] = {
        "matmul": 0.0,
        "attention": 0.0,
        "memory-bound": 0.0,
        "kernel boundaries": 0.0,
    }
    gpu_s, kernels = 0.0, 0
    for op in ops:
        seconds = op_seconds(op, hw, ach) * op.count
        gpu_s += seconds
        kernels += op.count
        kind = "attention" if op.kind.startswith("attention") else op.kind
        kind = kind if kind in by_kind else "memory-bound"
        by_kind[kind] += seconds - ach.kernel_gap_s * op.count
        by_kind["kernel boundaries"] += ach.kernel_gap_s * op.count
    return Compute(gpu_s=gpu_s, cpu_s=kernels * ach.cpu_issue_s, num_kernels=kernels, by_kind_s=by_kind)

"""Rules for the ddp strategy: its options, and what its communication hooks need."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def _ddp(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if p.strategy != "ddp":
        return
    if p.comm_hook not in COMM_HOOKS:
        yield SpecError(
            ("parallel.comm_hook",),
            f"unknown DDP communication hook '{p.comm_hook}'. Choose one of: {', '.join(COMM_HOOKS)}.",
        )
    if p.bucket_mb <= 0:
        yield SpecError(("parallel.bucket_mb",), f"must be positive, got {p.bucket_mb}; DDP's default is 25.")
    if p.comm_hook == "bf16" and hw.device_type != "cuda":
        yield SpecError(
            ("parallel.comm_hook", "launcher.device"),
            f"the bf16 compression hook needs NCCL on CUDA GPUs (torch refuses it on gloo), and this run is "
            f"on {hw.device_type}. Use `parallel.comm_hook=fp16` or `powersgd` here.",
        )
    if p.comm_hook == "powersgd":
        if p.powersgd_rank < 1:
            yield SpecError(("parallel.powersgd_rank",), f"must be at least 1, got {p.powersgd_rank}.")
        if p.powersgd_start_iter < 2:
            yield SpecError(
                ("parallel.powersgd_start_iter",),
                f"PowerSGD with error feedback can start at step 2 at the earliest, got {p.powersgd_start_iter}.",
            )
    if p.static_graph and spec.train.grad_accum_steps > 1:
        yield SpecError(
            ("parallel.static_graph", "train.grad_accum_steps"),
            "DDP's static graph fails on accumulation steps run under no_sync (an internal assertion in "
            "its reducer). Set parallel.static_graph=false, or train.grad_accum_steps=1.",
        )


RULES: tuple[Rule, ...] = (_ddp,)
"""This module's rules, in the order they report."""

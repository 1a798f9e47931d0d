"""Every name-valued key of the spec is one of its registered options (did-you-mean when it is not)."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.components.optimizer import OPTIMIZERS
from launcher.config.data import DATA_KINDS
from launcher.config.launcher import BACKENDS
from launcher.config.memory import ACTIVATION_CHECKPOINTING, SELECTIVE_MATMULS
from launcher.config.model import ATTENTION, FAMILIES
from launcher.config.quantization import METHODS
from launcher.config.scheduler import SCHEDULES
from launcher.parallel.pipeline_split import SCHEDULES as PP_SCHEDULES
from launcher.parallel.registry import STRATEGIES
from launcher.plan.roofline import HARDWARE
from launcher.rules import flash
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError

MODEL_KINDS = tuple(FAMILIES)
SIMULATED_STRATEGIES = ("single", "fsdp", "tp", "ddp", "pp")
"""Strategies dry_run=simulate builds on fake tensors (DeepSpeed's engine decides its step by reading tensor values)."""
SIMULATED_PP_SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules dry_run=simulate steps (checked against real runs; the multi-stage ones are not yet)."""
NONFINITE_POLICIES = ("skip", "stop")
DEVICES = ("auto", "cpu", "cuda")


def _names(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    yield from choice("parallel.strategy", spec.parallel.strategy, sorted(STRATEGIES), "parallel strategy")
    yield from choice("parallel.pp_schedule", spec.parallel.pp_schedule, PP_SCHEDULES, "pipeline schedule")
    yield from choice("optimizer.name", spec.optimizer.name, sorted(OPTIMIZERS), "optimizer")
    yield from choice("scheduler.name", spec.scheduler.name, SCHEDULES, "schedule")
    yield from choice("data.kind", spec.data.kind, DATA_KINDS, "data kind")
    yield from choice("model.kind", spec.model.kind, MODEL_KINDS, "model kind")
    yield from choice("quantization.method", spec.quantization.method, METHODS, "quantization method")
    yield from choice(
        "memory.activation_checkpointing",
        spec.memory.activation_checkpointing,
        ACTIVATION_CHECKPOINTING,
        "activation checkpointing mode",
    )
    yield from choice("memory.selective_matmuls", spec.memory.selective_matmuls, SELECTIVE_MATMULS, "option")
    if not flash.asks_flash(spec.model.attention):  # launcher.rules.flash explains those
        yield from choice("model.attention", spec.model.attention, ATTENTION, "attention path")
    yield from choice("launcher.backend", spec.launcher.backend, BACKENDS, "launch backend")
    yield from choice("train.on_nonfinite", spec.train.on_nonfinite, NONFINITE_POLICIES, "policy")
    yield from choice("launcher.device", spec.launcher.device, DEVICES, "device")
    if not isinstance(spec.dry_run, bool) and spec.dry_run not in ("all", "simulate"):
        yield SpecError(
            ("dry_run",),
            "must be false, true (the keys that differ from the defaults), all (every key) or simulate "
            f"(build and step one rank of each role on a fake process group), got {spec.dry_run!r}.",
        )
    yield from choice("simulate_hardware", spec.simulate_hardware, tuple(HARDWARE), "hardware profile")
    if spec.dry_run == "simulate":
        yield from _simulated_layout(spec)
    if spec.dry_run == "simulate" and spec.parallel.cp_size > 1:
        yield SpecError(
            ("dry_run", "parallel.cp_size"),
            "dry_run=simulate steps whole sequences and does not split them over a context-parallel group yet. "
            "Use dry_run=true for the context-parallel plan (activations divided by cp_size, gathered keys "
            "and values), or simulate with parallel.cp_size=1.",
        )
    if spec.dry_run == "simulate" and spec.objective.name != "sft":
        online = spec.objective.name in ("grpo", "rloo")
        needs = "rollouts sampled from prompts and scored" if online else "preference pairs and a reference"
        plan = (
            "the rollouts' key-value cache, the reference"
            if online
            else "a pair as two rows, the reference's weights"
        )
        yield SpecError(
            ("dry_run", "objective.name"),
            f"dry_run=simulate steps the cross-entropy objective on random token ids; objective="
            f"{spec.objective.name} needs {needs}. Use dry_run=true for its plan ({plan}), or simulate "
            "objective=sft for the parallel layout.",
        )


def _simulated_layout(spec: RunSpec) -> Iterator[SpecError]:
    """What dry_run=simulate cannot build on fake tensors and a fake process group, refused before building."""
    p = spec.parallel
    if p.strategy in STRATEGIES and p.strategy not in SIMULATED_STRATEGIES:
        yield SpecError(
            ("dry_run", "parallel.strategy"),
            f"dry_run=simulate builds {', '.join(SIMULATED_STRATEGIES)} on fake tensors; DeepSpeed "
            f"(parallel.strategy={p.strategy}) cannot run there: its engine moves the model with "
            "module.to, which swaps each parameter and torch refuses for these fake ones, and its step "
            "reads values on the host (the overflow flag, the gradient norm) to decide whether to step, "
            "which a fake tensor cannot answer. Use dry_run=true for its memory plan, or simulate the "
            "same sharding with parallel=fsdp (ZeRO-3; parallel=fsdp_shard_grad_op for ZeRO-2).",
        )
    if p.pp_size > 1 and p.pp_schedule not in SIMULATED_PP_SCHEDULES:
        yield SpecError(
            ("dry_run", "parallel.pp_schedule"),
            f"dry_run=simulate steps the pipeline schedules {', '.join(SIMULATED_PP_SCHEDULES)} (checked "
            f"against real runs); {p.pp_schedule} holds several stages per rank and is not checked yet. Use "
            "dry_run=true for its plan per pipeline rank, or simulate parallel.pp_schedule=1f1b for the "
            "stages' layout.",
        )
    if p.strategy == "ddp" and p.comm_hook != "none":
        yield SpecError(
            ("dry_run", "parallel.comm_hook"),
            f"dry_run=simulate runs DDP's own bucket all-reduce; the {p.comm_hook} hook takes its result from "
            "what the group delivers, and the fake process group delivers nothing. Use dry_run=true for "
            "its plan, or simulate parallel.comm_hook=none (the same buckets, uncompressed).",
        )


RULES: tuple[Rule, ...] = (_names,)
"""This module's rules, in the order they report."""

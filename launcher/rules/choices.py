"""Every name-valued key of the spec is one of its registered options (did-you-mean when it is not)."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.components.optimizer import OPTIMIZERS
from launcher.config.data import DATA_KINDS
from launcher.config.launcher import BACKENDS
from launcher.config.memory import ACTIVATION_CHECKPOINTING, SELECTIVE_MATMULS
from launcher.config.model import ATTENTION
from launcher.config.quantization import METHODS
from launcher.config.scheduler import SCHEDULES
from launcher.parallel.pipeline_split import SCHEDULES as PP_SCHEDULES
from launcher.parallel.registry import STRATEGIES
from launcher.plan.roofline import HARDWARE
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError

MODEL_KINDS = ("gpt", "hf")
SIMULATED_STRATEGIES = ("single", "fsdp", "tp")
"""Strategies dry_run=simulate builds on fake tensors (DDP's reducer and DeepSpeed's engine read tensor data)."""
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
    if spec.dry_run == "simulate" and spec.parallel.strategy not in SIMULATED_STRATEGIES:
        yield SpecError(
            ("dry_run", "parallel.strategy"),
            f"dry_run=simulate builds the torch-native strategies {', '.join(SIMULATED_STRATEGIES)} on fake "
            f"tensors; {spec.parallel.strategy!r} reads tensor data while it builds (DDP's reducer, DeepSpeed's "
            "engine). Use dry_run=true for its memory plan, or simulate parallel=fsdp.",
        )
    if spec.dry_run == "simulate" and spec.parallel.pp_size > 1:
        yield SpecError(
            ("dry_run", "parallel.pp_size"),
            "dry_run=simulate does not build pipelines yet: a pipeline stage learns its neighbours' tensor "
            "shapes by receiving them, and the fake process group sends nothing. Use dry_run=true for the "
            "pipeline's plan per pipeline rank.",
        )
    if spec.dry_run == "simulate" and spec.parallel.cp_size > 1:
        yield SpecError(
            ("dry_run", "parallel.cp_size"),
            "dry_run=simulate steps whole sequences and does not split them over a context-parallel group yet. "
            "Use dry_run=true for the context-parallel plan (activations divided by cp_size, gathered keys "
            "and values), or simulate with parallel.cp_size=1.",
        )
    if spec.dry_run == "simulate" and spec.objective.name != "sft":
        yield SpecError(
            ("dry_run", "objective.name"),
            f"dry_run=simulate steps the cross-entropy objective on random token ids; objective="
            f"{spec.objective.name} needs preference pairs and a reference. Use dry_run=true for its plan (a "
            "pair as two rows, the reference's weights), or simulate objective=sft for the parallel layout.",
        )


RULES: tuple[Rule, ...] = (_names,)
"""This module's rules, in the order they report."""

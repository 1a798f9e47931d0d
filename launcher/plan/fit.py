"""Whether a run fits its GPU, and the planner's cheapest fixes when it does not.

The launching process knows the planned bytes per rank (launcher.plan.planner) before anything
starts; a plan above the device's memory is an out-of-memory error waiting to happen minutes into
a job. `too_large` is the decision, a pure function of a plan and the device's bytes; `fixes`
re-plans the spec with each memory technique the planner counts, cheapest in speed first:
activation checkpointing (about a third more compute), an 8-bit optimizer (a little optimizer
time), sharding over the ranks (communication), offload to CPU (PCIe traffic, the slowest); then
QLoRA, which trains LoRA adapters on nf4 weights instead of the weights themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from launcher.config.adapters import LoRAConfig
from launcher.config.quantization import QuantizationConfig
from launcher.plan.planner import MemoryPlan, plan
from launcher.plan.render import format_bytes
from launcher.spec import RunSpec, SpecError

EIGHT_BIT = {"adamw": "adamw_8bit"}
"""Optimizers with an 8-bit version the planner counts."""


@dataclass(frozen=True, kw_only=True)
class Fix:
    """One change the planner can price, and its planned bytes per rank."""

    overrides: tuple[str, ...]
    """What to add to the command line."""
    total: int
    """Planned device bytes per rank with it."""


def too_large(memory: MemoryPlan, device_bytes: int) -> bool:
    """Whether the planned bytes per rank exceed the device's memory (unknown memory, 0: never)."""
    return device_bytes > 0 and memory.total > device_bytes


Change = tuple[str, Callable[[RunSpec], RunSpec]]
"""An override for the command line, and what it does to a spec."""


def _checkpointing(spec: RunSpec) -> RunSpec:
    memory = dataclasses.replace(spec.memory, activation_checkpointing="blocks", checkpoint_every=1)
    return dataclasses.replace(spec, memory=memory)


def _eight_bit(spec: RunSpec) -> RunSpec:
    optimizer = dataclasses.replace(spec.optimizer, name=EIGHT_BIT[spec.optimizer.name])
    return dataclasses.replace(spec, optimizer=optimizer)


def _fsdp(spec: RunSpec) -> RunSpec:
    parallel = dataclasses.replace(
        spec.parallel, strategy="fsdp", reshard_after_forward=True, cpu_offload=False
    )
    return dataclasses.replace(spec, parallel=parallel)


def _fsdp_offload(spec: RunSpec) -> RunSpec:
    parallel = dataclasses.replace(
        spec.parallel, strategy="fsdp", reshard_after_forward=True, cpu_offload=True
    )
    return dataclasses.replace(spec, parallel=parallel)


QLORA = QuantizationConfig(
    method="nf4", double_quant=True, lora=LoRAConfig(rank=16, alpha=32.0, dropout=0.05)
)
"""What `quantization=nf4_lora` sets (conf/quantization/nf4_lora.yaml; a unit test holds the two equal)."""


def _qlora(spec: RunSpec) -> RunSpec:
    return dataclasses.replace(spec, quantization=QLORA)


def _zero3_offload(spec: RunSpec) -> RunSpec:
    parallel = dataclasses.replace(
        spec.parallel, strategy="deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True
    )
    return dataclasses.replace(spec, parallel=parallel)


def _offload_activations(spec: RunSpec) -> RunSpec:
    return dataclasses.replace(spec, memory=dataclasses.replace(spec.memory, offload_activations=True))


def _candidates(spec: RunSpec) -> list[Change]:
    """The techniques this spec does not use yet that keep what trains, cheapest first."""
    out: list[Change] = []
    m, p = spec.memory, spec.parallel
    if m.activation_checkpointing != "blocks" or m.checkpoint_every != 1:
        out.append(("memory.activation_checkpointing=blocks", _checkpointing))
    if spec.optimizer.name in EIGHT_BIT:
        out.append((f"optimizer={EIGHT_BIT[spec.optimizer.name]}", _eight_bit))
    several, no_tp, dp = spec.launcher.world_size > 1, p.tp_size <= 1, p.method
    if dp.replicates and several:
        out.append(("parallel=fsdp", _fsdp))
    if (dp.replicates or (dp.shards and not p.cpu_offload)) and several and no_tp:
        out.append(
            ("parallel=fsdp_offload", _fsdp_offload)
        )  # one rank shards nothing: zero3_offload offloads
    if (dp.replicates or dp.owns_engine) and not (p.offload_optimizer and p.offload_params):
        out.append(("parallel=zero3_offload", _zero3_offload))
    if not m.offload_activations:
        out.append(("memory.offload_activations=true", _offload_activations))
    return out


def _changing_what_trains(spec: RunSpec) -> list[Change]:
    """Fixes that train something else, listed alone after the others: QLoRA (nf4 base weights, LoRA adapters
    only), where full weights train and the strategy can hold nf4 (not tensor parallel, not ZeRO-3)."""
    p, q = spec.parallel, spec.quantization
    if q.method != "none" or q.lora.rank > 0 or p.tp_size > 1 or p.engine_partitions_parameters:
        return []
    return [("quantization=nf4_lora", _qlora)]


def fixes(spec: RunSpec, device_type: str = "cuda") -> list[Fix]:
    """Each technique alone, cheapest first, then the cheapest ones together: two, three, ... all; then QLoRA
    alone (it trains adapters instead of the weights, so it is never slipped into a combination).

    Together, a later parallel strategy replaces an earlier one (zero3_offload over fsdp_offload over fsdp).
    """
    candidates = _candidates(spec)
    found = [
        Fix(overrides=(o,), total=plan(change(spec), device_type=device_type).total)
        for o, change in [*candidates, *_changing_what_trains(spec)]
    ]
    combined, overrides = spec, {}
    for num, (override, change) in enumerate(candidates, 1):
        combined = change(combined)
        overrides["parallel" if override.startswith("parallel=") else override] = override
        if num > 1:
            total = plan(combined, device_type=device_type).total
            found.append(Fix(overrides=tuple(overrides.values()), total=total))
    return found


def _worth_listing(found: list[Fix], device_bytes: int) -> list[Fix]:
    """Every single fix; combinations only when no single one fits, up to the first combination that does."""
    singles = [f for f in found if len(f.overrides) == 1]
    if any(f.total <= device_bytes for f in singles):
        return singles
    listed = list(singles)
    for fix in found[len(singles) :]:
        listed.append(fix)
        if fix.total <= device_bytes:
            break
    return listed


def memory_error(
    memory: MemoryPlan, device_bytes: int, found: list[Fix], device_name: str = ""
) -> SpecError | None:
    """The error of a plan too large for its device (`device_name`: which; empty: this GPU), listing the fixes
    with their planned bytes per rank."""
    if not too_large(memory, device_bytes):
        return None
    listed = "; ".join(
        f"{' '.join(f.overrides)}: {format_bytes(f.total)}{' (fits)' if f.total <= device_bytes else ''}"
        for f in _worth_listing(found, device_bytes)
    )
    return SpecError(
        ("train.micro_batch_size", "launcher.device"),
        f"the planned memory per rank, {format_bytes(memory.total)}, exceeds the {format_bytes(device_bytes)} of "
        f"{device_name or 'this GPU'}: the run would stop out of memory. The planner's fixes, cheapest first, with their "
        f"planned memory per rank: {listed or 'none left to try'}. Or lower train.micro_batch_size and raise "
        "train.grad_accum_steps to keep the global batch (`train dry_run=true` prints the whole plan).",
    )

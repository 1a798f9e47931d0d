"""Every cross-field rule of the run spec, checked once before anything starts; each names keys and a fix.

One module per area, each with a `RULES` tuple of functions `(spec, hw) -> Iterator[SpecError]`.
`check` runs the rules of every module in `AREAS`, which are imported here statically: nothing
registers itself on import, and tests/unit/test_architecture.py fails when a rules module (or a
rule function) exists that `check` would not run.
"""

from __future__ import annotations

from launcher.rules import (
    choices,
    context,
    data,
    ddp,
    deepspeed,
    distill,
    flash,
    hf_model,
    launch,
    loggers,
    loop,
    memory,
    mixture,
    model,
    numbers,
    objective,
    optimizer,
    pipeline,
    precision,
    profiling,
    prune,
    qat,
    quantization,
    records,
    resume,
    safe_files,
    sharding,
    slurm,
)
from launcher.rules import compile as compiling
from launcher.rules.hardware import Hardware, detect_hardware
from launcher.spec import RunSpec, SpecError

AREAS = (
    numbers,
    choices,
    model,
    precision,
    loop,
    data,
    mixture,
    launch,
    resume,
    safe_files,
    slurm,
    memory,
    compiling,
    profiling,
    deepspeed,
    quantization,
    qat,
    prune,
    distill,
    objective,
    optimizer,
    hf_model,
    flash,
    records,
    loggers,
    ddp,
    sharding,
    pipeline,
    context,
)
"""The rule modules `check` runs, in the order their errors are reported."""

__all__ = ["AREAS", "Hardware", "check", "detect_hardware"]


def check(spec: RunSpec, hw: Hardware) -> list[SpecError]:
    """All violations of all rules, so that one run of the CLI reports every problem at once."""
    return [error for area in AREAS for rule in area.RULES for error in rule(spec, hw)]

"""Every cross-field rule of the run spec, checked once before anything starts; each names keys and a fix.

One module per area, each with a `RULES` tuple of functions `(spec, hw) -> Iterator[SpecError]`.
`check` runs the rules of every module in `AREAS`, which are imported here statically: nothing
registers itself on import, and tests/unit/test_architecture.py fails when a rules module (or a
rule function) exists that `check` would not run.
"""

from __future__ import annotations

import re

from launcher.rules import (
    best,
    choices,
    context,
    data,
    ddp,
    deepspeed,
    distill,
    eval_generation,
    evaluation,
    flash,
    hf_model,
    keys,
    launch,
    loggers,
    loop,
    memory,
    mixture,
    model,
    moe,
    numbers,
    objective,
    online,
    optimizer,
    pipeline,
    precision,
    profiling,
    prune,
    qat,
    quantization,
    records,
    resume,
    reward,
    safe_files,
    schedule,
    sharding,
    slurm,
)
from launcher.rules import compile as compiling
from launcher.rules.hardware import Hardware, detect_hardware
from launcher.spec import RunSpec, SpecError

AREAS = (
    keys,
    numbers,
    choices,
    model,
    moe,
    precision,
    loop,
    best,
    eval_generation,
    schedule,
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
    online,
    reward,
    optimizer,
    hf_model,
    flash,
    records,
    loggers,
    evaluation,
    ddp,
    sharding,
    pipeline,
    context,
)
"""The rule modules `check` runs, in the order their errors are reported."""

__all__ = ["AREAS", "Hardware", "check", "detect_hardware"]


def check(spec: RunSpec, hw: Hardware) -> list[SpecError]:
    """All violations of all rules, so that one run of the CLI reports every problem at once.

    A key's domain error (launcher.rules.keys) is left out where another rule named that key alone: its
    message is the more specific. While a value lies outside its domain, a cross-field rule that cannot
    judge it (a zero it divides by) stops without a word; the domain error says what to fix.
    """
    floor = [error for rule in keys.RULES for error in rule(spec, hw)]
    found: list[SpecError] = []
    for area in (area for area in AREAS if area is not keys):  # keys ran first, above
        for rule in area.RULES:
            try:
                found.extend(rule(spec, hw))
            except Exception:
                if not floor:
                    raise
    named = {tuple(re.sub(r"\[\d+\]$", "", key) for key in error.keys) for error in found}  # betas[1]: betas
    return [error for error in floor if error.keys not in named] + found

"""Rules of the optimizer group, checked before anything starts: the memory-lean options' packages and
kernels, the Adam family's betas, and (`unread_keys`) no key set on purpose for an optimizer that ignores it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from launcher.config.optimizer import BNB_OPTIMIZERS, READS, reads
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, missing
from launcher.spec import RunSpec, SpecError

ADAM_FAMILY = ("adamw", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "muon", "adamw_schedule_free")


def _bitsandbytes(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.optimizer
    if o.name not in BNB_OPTIMIZERS:
        return
    yield from missing(
        "bitsandbytes",
        ("optimizer.name",),
        f"optimizer={o.name} comes from bitsandbytes, which is not installed. Install it with "
        "`pip install -e '.[bnb]'` (or `pip install bitsandbytes`), or use `optimizer=adamw`.",
    )
    if o.implementation != "auto":
        yield SpecError(
            ("optimizer.implementation", "optimizer.name"),
            f"optimizer={o.name} has a single bitsandbytes kernel, so implementation={o.implementation} "
            "does not apply. Leave optimizer.implementation=auto.",
        )


def _adafactor(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.optimizer
    if o.name != "adafactor":
        return
    import torch  # only this option asks which optimizers the installed torch has

    if not hasattr(torch.optim, "Adafactor"):
        yield SpecError(
            ("optimizer.name",),
            f"torch {torch.__version__} has no torch.optim.Adafactor (it arrived in torch 2.5). "
            "Upgrade torch, or use `optimizer=adamw_8bit` for low optimizer memory.",
        )
    if o.implementation == "fused":
        yield SpecError(
            ("optimizer.implementation", "optimizer.name"),
            "torch's Adafactor has no fused kernel. Use optimizer.implementation=auto, foreach or for_loop.",
        )


def _betas(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.optimizer
    if o.name not in ADAM_FAMILY:
        return
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        yield SpecError(
            ("optimizer.betas",),
            f"{o.name} takes two coefficients in [0, 1), got {list(o.betas)}. A usual choice is "
            "[0.9, 0.95] (Adam) or [0.9, 0.99] (Lion).",
        )


def _offloaded_adamw(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.optimizer
    if spec.parallel.offload_optimizer and o.name == "adamw" and o.implementation != "auto":
        yield SpecError(
            ("optimizer.implementation", "parallel.offload_optimizer"),
            "with parallel.offload_optimizer=true, AdamW steps as DeepSpeed's CPU Adam, which has one kernel, so "
            f"optimizer.implementation={o.implementation} would be ignored. Leave optimizer.implementation=auto.",
        )


def _muon(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.optimizer
    if o.name != "muon":
        return
    if spec.parallel.strategy != "deepspeed":
        return
    stage = spec.parallel.zero_stage
    why = (
        "ZeRO stage 0 is plain data parallelism, which parallel=ddp runs with Muon"
        if stage == 0
        else f"ZeRO stage {stage} steps the optimizer on flattened 1-D partitions of the parameters, where "
        "no matrix is left"
    )
    yield SpecError(
        ("optimizer.name", "parallel.strategy"),
        f"optimizer=muon orthogonalizes each whole hidden matrix and is not wired into DeepSpeed's engine "
        f"(parallel.strategy=deepspeed): {why}. Use parallel=fsdp (FSDP2: Muon gathers each sharded "
        "matrix) or parallel=ddp, or keep DeepSpeed with optimizer=adamw.",
    )


RULES: tuple[Rule, ...] = (_bitsandbytes, _adafactor, _betas, _offloaded_adamw, _muon)
"""This module's rules, in the order they report."""

HINTS = {
    ("adafactor", "betas"): "Adafactor keeps no first moment and decays its second moments on a schedule: "
    "set optimizer.beta2_decay (beta2 at step t = 1 - t ** beta2_decay) instead. ",
}
"""A fix more specific than the generic one, for an (optimizer, key) pair users reach for."""


def unread_keys(name: str, set_by: Mapping[str, str]) -> list[SpecError]:
    """One error per optimizer.* key set on purpose (`set_by`: dotted key -> who set it) that optimizer `name`
    does not read, so that no value reaches spec.yaml and is then ignored without a word.

    The front calls this with launcher.front.provenance.explicit: keys left at their defaults are never refused.
    """
    if name not in READS:
        return []  # an unknown option: the domain rule names it
    read = reads(name)
    listed = ", ".join(f"optimizer.{field}" for field in read if field != "name")
    errors = []
    for key, source in sorted(set_by.items()):
        group, _, field = key.partition(".")
        if group != "optimizer" or not field or field in read:
            continue
        takers = [option for option in READS if field in reads(option)]
        elsewhere = f", or pick an optimizer that reads it ({', '.join(takers)})" if takers else ""
        errors.append(
            SpecError(
                (key,),
                f"{key} is set ({_by(source)}) but optimizer={name} does not read it, so it would be ignored. "
                f"{HINTS.get((name, field), '')}optimizer={name} reads {listed}. "
                f"Remove {key} from {_where(source)}{elsewhere}.",
            )
        )
    return errors


def _by(source: str) -> str:
    return "on the command line" if source == "command line" else f"by {source}"


def _where(source: str) -> str:
    return "the command line" if source == "command line" else f"the file of {source}"

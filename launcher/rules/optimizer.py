"""Rules of the optimizer group's memory-lean options, checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.optimizer import BNB_OPTIMIZERS
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, missing
from launcher.spec import RunSpec, SpecError

ADAM_FAMILY = ("adamw", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "adamw_schedule_free")


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


RULES: tuple[Rule, ...] = (_bitsandbytes, _adafactor, _betas)
"""This module's rules, in the order they report."""

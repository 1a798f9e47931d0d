"""Rules of the loop and its schedule: lengths, batch, cadence, clipping, learning rate and warmup."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, positive
from launcher.spec import RunSpec, SpecError


def _loop(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    t = spec.train
    yield from positive("train.max_steps", t.max_steps)
    yield from positive("log.progress_every_s", spec.log.progress_every_s, "Use null for no progress lines.")
    yield from positive("train.micro_batch_size", t.micro_batch_size, "Lower it to fit memory, not below 1.")
    yield from positive("train.grad_accum_steps", t.grad_accum_steps, "Use 1 for no accumulation.")
    yield from positive("train.log_every", t.log_every)
    yield from positive(
        "train.eval_every", t.eval_every, "Use `train.eval_every=null` to turn evaluation off."
    )
    yield from positive("train.eval_batches", t.eval_batches)
    yield from positive(
        "train.max_grad_norm", t.max_grad_norm, "Use `train.max_grad_norm=null` to turn clipping off."
    )
    yield from positive(
        "checkpoint.every", spec.checkpoint.every, "Use `checkpoint.every=null` to turn checkpoints off."
    )
    yield from positive("checkpoint.keep", spec.checkpoint.keep, "Keep at least 1 checkpoint.")
    yield from positive("optimizer.lr", spec.optimizer.lr, "A typical AdamW value is 3e-4.")
    if t.stop_after is not None and 0 < t.max_steps <= t.stop_after:  # below 1: launcher.rules.keys says so
        yield SpecError(
            ("train.stop_after", "train.max_steps"),
            f"stop_after ({t.stop_after}) must lie below max_steps ({t.max_steps}): an optimizer step from 1 to "
            f"{t.max_steps - 1}; use null to train to the end.",
        )
    if spec.optimizer.weight_decay < 0:
        yield SpecError(("optimizer.weight_decay",), "must be 0 or more (0 turns weight decay off).")
    if not 0.0 < t.max_nonfinite_fraction <= 1.0:
        yield SpecError(
            ("train.max_nonfinite_fraction",),
            f"must lie in (0, 1], got {t.max_nonfinite_fraction}; 0.5 stops a run once more than half of "
            "the last train.nonfinite_window_steps steps were skipped, 1 never stops on the share.",
        )
    yield from positive("train.nonfinite_window_steps", t.nonfinite_window_steps)
    if t.max_nonfinite_skips < 0:
        yield SpecError(("train.max_nonfinite_skips",), f"must be 0 or more, got {t.max_nonfinite_skips}.")


def _schedule(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    s = spec.scheduler
    if s.warmup_steps < 0:
        yield SpecError(("scheduler.warmup_steps",), "must be 0 or more.")
    elif s.warmup_steps >= spec.train.max_steps > 0:
        yield SpecError(
            ("scheduler.warmup_steps", "train.max_steps"),
            f"warmup ({s.warmup_steps} steps) is not shorter than the run ({spec.train.max_steps} steps), "
            "so the learning rate would never reach its peak. Lower scheduler.warmup_steps or raise train.max_steps.",
        )
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        yield SpecError(("scheduler.min_lr_ratio",), f"must lie in [0, 1], got {s.min_lr_ratio}.")


RULES: tuple[Rule, ...] = (_loop, _schedule)
"""This module's rules, in the order they report."""

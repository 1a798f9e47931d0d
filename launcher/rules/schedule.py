"""Rules of the learning-rate schedule's own keys and of schedule-free AdamW, which replaces the schedule."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.scheduler import FLOORED, SchedulerConfig, decay_steps_of, warmup_of
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, missing
from launcher.spec import RunSpec, SpecError

SCHEDULE_FREE = "adamw_schedule_free"
DEFAULTS = SchedulerConfig()


def _schedule_free(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o, s = spec.optimizer, spec.scheduler
    if o.name != SCHEDULE_FREE:
        return
    yield from missing(
        "schedulefree",
        ("optimizer.name",),
        f"optimizer={SCHEDULE_FREE} comes from the schedulefree package, which is not installed. Install it "
        "with `pip install -e '.[schedulefree]'` (or `pip install schedulefree`), or use `optimizer=adamw`.",
    )
    if s.name != "constant":
        yield SpecError(
            ("optimizer.name", "scheduler.name"),
            f"optimizer={SCHEDULE_FREE} replaces the learning-rate schedule (its averaged weights take the place "
            f"of a decay), so scheduler={s.name} would decay it twice. Add `scheduler=constant`; its "
            "scheduler.warmup_steps (or warmup_ratio) is the optimizer's warmup.",
        )
    if o.implementation == "fused":
        yield SpecError(
            ("optimizer.implementation", "optimizer.name"),
            f"optimizer={SCHEDULE_FREE} has no fused kernel. Use optimizer.implementation=auto, foreach or for_loop.",
        )
    if len(o.betas) == 2 and o.betas[0] == 0:
        yield SpecError(
            ("optimizer.betas",),
            f"optimizer={SCHEDULE_FREE} interpolates its averaged weights by 1/beta1, so betas[0] must be above "
            "0; the usual choice is [0.9, 0.999].",
        )
    if spec.parallel.strategy == "deepspeed":
        yield SpecError(
            ("optimizer.name", "parallel.strategy"),
            f"optimizer={SCHEDULE_FREE} switches the model's weights between its averaged and training points, "
            "and DeepSpeed's engine keeps its own copies of them, so evaluation and checkpoints would see the "
            "wrong ones. Use parallel=fsdp (sharded like ZeRO-3), parallel=ddp, or optimizer=adamw with DeepSpeed.",
        )
    if spec.prune.method != "none":
        yield SpecError(
            ("optimizer.name", "prune.method"),
            f"prune.method={spec.prune.method} zeroes the training weights, but optimizer={SCHEDULE_FREE} evaluates "
            "and saves an average that the mask never reaches. Use optimizer=adamw to prune.",
        )


def _warmup_ratio(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    s, steps = spec.scheduler, spec.train.max_steps
    if s.warmup_ratio is None or not 0 <= s.warmup_ratio < 1:  # launcher.rules.keys names the range
        return
    if s.warmup_steps != warmup_of(s, steps):
        yield SpecError(
            ("scheduler.warmup_steps", "scheduler.warmup_ratio"),
            f"warmup_steps={s.warmup_steps} and warmup_ratio={s.warmup_ratio} (= {warmup_of(s, steps)} of "
            f"train.max_steps={steps}) disagree. Set one of them: remove the other from the command line or file.",
        )


def _wsd(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    s, steps = spec.scheduler, spec.train.max_steps
    if s.name != "wsd":
        moved = [k for k in ("decay_ratio", "decay_shape") if getattr(s, k) != getattr(DEFAULTS, k)]
        if moved:
            keys = " and ".join(f"scheduler.{k}" for k in moved)
            yield SpecError(
                tuple(f"scheduler.{k}" for k in moved) + ("scheduler.name",),
                f"{keys} {'shapes' if len(moved) == 1 else 'shape'} the decay of scheduler=wsd, which "
                f"scheduler={s.name} does not have. Use `scheduler=wsd`, or drop {keys}.",
            )
        return
    if not 0 < s.decay_ratio <= 1 or steps < 1:  # launcher.rules.keys names the range
        return
    warmup, decay = warmup_of(s, steps), decay_steps_of(s, steps)
    if warmup + decay > steps:
        yield SpecError(
            ("scheduler.decay_ratio", "scheduler.warmup_steps", "train.max_steps"),
            f"scheduler=wsd decays over the last {decay} of train.max_steps={steps} steps "
            f"(decay_ratio={s.decay_ratio}), which overlaps the {warmup} warmup steps. Lower "
            "scheduler.decay_ratio or the warmup, or raise train.max_steps.",
        )


def _floor(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    s = spec.scheduler
    if s.name not in FLOORED and s.min_lr_ratio != DEFAULTS.min_lr_ratio:
        yield SpecError(
            ("scheduler.min_lr_ratio", "scheduler.name"),
            f"scheduler={s.name} never decays, so min_lr_ratio={s.min_lr_ratio} would not be read. Use a decaying "
            f"schedule ({', '.join(FLOORED)}) or drop scheduler.min_lr_ratio.",
        )


RULES: tuple[Rule, ...] = (_schedule_free, _warmup_ratio, _wsd, _floor)
"""This module's rules, in the order they report."""

"""Rules of online RL (objective=grpo, rloo) and its prompt data (data.format=prompt), checked before launch.

What does not compose is refused with the fix: a pipeline, tensor or context parallelism (the objective
rules refuse them for every non-sft objective), DeepSpeed (its engine owns the module: generation over
ZeRO-3 partitions is not done), packing, a step whose completions do not make whole groups, fewer than
two completions per prompt, an online objective without data.format=prompt, or without a reward. The prompts' own sizes
(a prompt longer than data.seq_len - objective.max_completion_length, too few prompts) are checked
when they are read, before launch (launcher.front.prompt_data).
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.objective import LOSS_TYPES, ONLINE, SCALE_REWARDS
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


def _data(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o, d = spec.objective, spec.data
    online = o.name in ONLINE
    if d.format == "prompt" and not online:
        yield SpecError(
            ("data.format", "objective.name"),
            f"data.format=prompt holds prompts without responses, which objective={o.name} cannot train on: "
            "add objective=grpo (or rloo) and a reward (docs/rl.md), or use a supervised format.",
        )
    if not online:
        return
    if d.format != "prompt":
        yield SpecError(
            ("objective.name", "data.format"),
            f"objective={o.name} samples its completions from prompts: set data.format=prompt (records with "
            f"`prompt` or `messages`, plus the fields the rewards read), got data.format={d.format}.",
        )
    if d.packing:
        yield SpecError(
            ("objective.name", "data.packing"),
            f"objective={o.name} trains each prompt and completion as its own row, which packing would join: "
            "set data.packing=false (`objective=grpo` sets it).",
        )
    if d.sources:
        yield SpecError(
            ("objective.name", "data.sources"),
            f"objective={o.name} reads one data.path; remove data.sources.",
        )
    if d.format == "prompt" and not spec.reward.configured():
        yield SpecError(
            ("objective.name", "reward"),
            f"objective={o.name} learns from rewards, and none is configured: choose a preset (`reward=math`: the "
            "record's `answer` against the completion's last number or \\boxed{}), set a built-in "
            "(reward.answer.weight=1, or reward.format.weight=1 with reward.format.pattern=...), or name your own "
            "function (reward.functions=[path/to/rewards.py:fn], TRL's signature). docs/rl.md shows each.",
        )


def _groups(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o, t = spec.objective, spec.train
    if o.name not in ONLINE:
        return
    if o.num_generations < 2:
        yield SpecError(
            ("objective.num_generations",),
            f"must be at least 2, got {o.num_generations}: a group's advantages compare its completions with each "
            "other, so one completion alone learns nothing. TRL's default is 8.",
        )
        return
    rows = t.micro_batch_size * t.grad_accum_steps
    if rows % o.num_generations:
        yield SpecError(
            ("train.micro_batch_size", "train.grad_accum_steps", "objective.num_generations"),
            f"each rank's step takes train.micro_batch_size {t.micro_batch_size} x train.grad_accum_steps "
            f"{t.grad_accum_steps} = {rows} completions, not a whole number of groups of objective.num_generations "
            f"{o.num_generations}: a group must lie on one rank. Make the product a multiple of "
            f"{o.num_generations} (e.g. train.micro_batch_size={o.num_generations}).",
        )
    if o.max_completion_length >= spec.data.seq_len:
        yield SpecError(
            ("objective.max_completion_length", "data.seq_len"),
            f"objective.max_completion_length {o.max_completion_length} leaves no room for a prompt in data.seq_len "
            f"{spec.data.seq_len}: lower it or raise data.seq_len.",
        )


def _settings(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.objective
    if o.name not in ONLINE:
        return
    if o.loss_type not in LOSS_TYPES:
        yield SpecError(
            ("objective.loss_type",), f"must be one of {', '.join(LOSS_TYPES)}, got {o.loss_type!r}."
        )
    if o.scale_rewards not in SCALE_REWARDS:
        yield SpecError(
            ("objective.scale_rewards",),
            f"must be one of {', '.join(SCALE_REWARDS)} (none: Dr. GRPO), got {o.scale_rewards!r}.",
        )
    if o.beta < 0:
        yield SpecError(("objective.beta",), f"must be 0 (no reference) or positive, got {o.beta}.")
    if o.overlong_buffer >= o.max_completion_length and o.overlong_buffer > 0:
        yield SpecError(
            ("objective.overlong_buffer", "objective.max_completion_length"),
            f"the soft overlong penalty starts at max_completion_length - overlong_buffer = "
            f"{o.max_completion_length - o.overlong_buffer} tokens: keep objective.overlong_buffer below "
            f"objective.max_completion_length {o.max_completion_length} (DAPO: a quarter of it).",
        )


def _placement(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o, p = spec.objective, spec.parallel
    if o.name in ONLINE and p.method.owns_engine:
        yield SpecError(
            ("objective.name", "parallel.strategy"),
            f"objective={o.name} samples with the model as it trains, and DeepSpeed's engine owns the module (under "
            "ZeRO-3 its parameters are partitioned outside generation's reach): use `parallel=fsdp` (shards, "
            "gathered layer by layer while sampling) or `parallel=ddp`.",
        )


RULES: tuple[Rule, ...] = (_data, _groups, _settings, _placement)
"""This module's rules, in the order they report."""

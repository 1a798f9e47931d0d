"""Prompt data (data.format=prompt) checked before launch: every prompt read and encoded, counted, measured.

Online RL reads prompts rather than a token cache (launcher.components.data.prompts), so the size checks
are about prompts and groups: a prompt longer than data.seq_len - objective.max_completion_length would
leave its completions no room and is refused, named; so is a data set with fewer prompts than one
optimizer step samples (train.micro_batch_size x train.grad_accum_steps x data-parallel ranks completions,
objective.num_generations per prompt), which would repeat a prompt inside one step.
"""

from __future__ import annotations

from launcher.components.data.prompts import read_prompts
from launcher.components.data.sources import RecordError
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import cache_root
from launcher.front.data_sizes import step_needs
from launcher.spec import RunSpec, SpecError


def prompt_errors(spec: RunSpec) -> list[SpecError]:
    """The problems of a prompt data set for the run (a bad record, a prompt too long, too few prompts)."""
    d, o = spec.data, spec.objective
    try:
        prompts = read_prompts(d, spec.tokenizer, load_tokenizer(spec.tokenizer), cache_root(d))
    except RecordError as err:
        return [
            SpecError(("data.path", "data.format"), f"{err} No rank was started. Fix or drop the record.")
        ]
    room = d.seq_len - o.max_completion_length
    too_long = [(where, len(p.ids)) for where, p in prompts if len(p.ids) > room]
    if too_long:
        where, length = max(too_long, key=lambda item: item[1])
        return [
            SpecError(
                ("data.seq_len", "objective.max_completion_length", "data.path"),
                f"{len(too_long):,} prompt(s) are longer than data.seq_len {d.seq_len} - "
                f"objective.max_completion_length {o.max_completion_length} = {room} tokens, the longest {length} "
                f"tokens ({where}), so their completions would not fit. Raise data.seq_len (within the model's "
                "context), lower objective.max_completion_length, or shorten those prompts.",
            )
        ]
    needs = step_needs(spec)
    per_step = needs.train_sequences // o.num_generations
    if len(prompts) < per_step:
        return [
            SpecError(
                (
                    "data.path",
                    "train.micro_batch_size",
                    "train.grad_accum_steps",
                    "objective.num_generations",
                ),
                f"data.path holds {len(prompts):,} prompt(s), fewer than one optimizer step samples: "
                f"train.micro_batch_size {spec.train.micro_batch_size} x train.grad_accum_steps "
                f"{spec.train.grad_accum_steps} x {needs.dp_size} data-parallel rank(s) = {needs.train_sequences} "
                f"completions, {o.num_generations} per prompt = {per_step} prompts. Add prompts, or lower "
                "train.micro_batch_size (or train.grad_accum_steps, launcher.nproc).",
            )
        ]
    return []

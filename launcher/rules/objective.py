"""Rules of the objective group (sft, and the preference losses dpo, simpo, orpo, kto), checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.objective import DPO_LOSSES, NAMES, NEEDS_REFERENCE, ONLINE, REFERENCES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

DATA_FORMAT = {"dpo": "preference", "simpo": "preference", "orpo": "preference", "kto": "kto"}
"""The data.format each preference objective reads."""
REFUSED = {
    "pp": "a pipeline's last stage sees only labels, not the chosen and rejected rows of a pair, and the reference "
    "would need the same stages and schedule",
    "tp": "tensor parallelism splits the vocabulary over ranks, so a row's log-prob would need a cross-rank "
    "log-softmax the preference losses do not do",
    "cp": "context parallel gives each rank two chunks of every row, so a response's log-prob would need a sum "
    "over the cp group the preference losses do not do",
}


def _settings(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o = spec.objective
    if o.name not in NAMES:
        yield SpecError(
            ("objective.name",), f"must be one of {', '.join(NAMES)}, got {o.name!r}: pick objective=dpo."
        )
        return
    if o.name in ONLINE:  # grpo and rloo: launcher.rules.online
        return
    if o.loss not in DPO_LOSSES:
        yield SpecError(("objective.loss",), f"must be one of {', '.join(DPO_LOSSES)}, got {o.loss!r}.")
    if o.reference not in REFERENCES:
        yield SpecError(
            ("objective.reference",), f"must be one of {', '.join(REFERENCES)}, got {o.reference!r}."
        )
    if o.beta <= 0:
        yield SpecError(("objective.beta",), f"must be positive, got {o.beta}. DPO's usual 0.1; SimPO's 2.0.")
    if not 0.0 <= o.label_smoothing < 0.5:
        yield SpecError(
            ("objective.label_smoothing",),
            f"must lie in [0, 0.5) (the share of flipped labels assumed), got {o.label_smoothing}.",
        )
    if o.desirable_weight < 0 or o.undesirable_weight < 0:
        yield SpecError(
            ("objective.desirable_weight", "objective.undesirable_weight"),
            "must not be negative; KTO's paper keeps desirable x count about equal to undesirable x count.",
        )


def _data(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o, d = spec.objective, spec.data
    pair_format = d.format in DATA_FORMAT.values()
    if o.name == "sft":
        if pair_format:
            yield SpecError(
                ("objective.name", "data.format"),
                f"data.format={d.format} holds preference data, which cross-entropy cannot train on: add "
                f"objective={'kto' if d.format == 'kto' else 'dpo'} (or simpo, orpo), or use a supervised format.",
            )
        return
    if o.name not in DATA_FORMAT:
        return
    want = DATA_FORMAT[o.name]
    if d.format != want:
        yield SpecError(
            ("objective.name", "data.format"),
            f"objective={o.name} trains on data.format={want} "
            f"({'prompt, chosen, rejected' if want == 'preference' else 'prompt, completion, label'}), got "
            f"data.format={d.format}. Set data.format={want} (docs/preference.md shows the layouts).",
        )
    if d.packing:
        yield SpecError(
            ("objective.name", "data.packing"),
            f"objective={o.name} needs whole pairs in one micro batch, chosen and rejected side by side, which packing "
            "would cut apart: set data.packing=false.",
        )
    if d.batching != "fixed":
        yield SpecError(
            ("objective.name", "data.batching"),
            f"objective={o.name} batches a fixed number of pairs (examples) per micro batch; data.batching="
            f"{d.batching} is refused: set data.batching=fixed.",
        )
    if d.sources:
        yield SpecError(
            ("objective.name", "data.sources"),
            f"objective={o.name} reads one data.path; remove data.sources.",
        )


def _placement(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    o, p = spec.objective, spec.parallel
    if o.name == "sft":
        return
    if p.pp_size > 1:
        yield SpecError(
            ("objective.name", "parallel.pp_size"),
            f"objective={o.name} does not run under a pipeline: {REFUSED['pp']}. Set parallel.pp_size=1 "
            "(`parallel=fsdp` shards model and reference instead).",
        )
    if p.strategy == "tp" or p.tp_size > 1:
        yield SpecError(
            ("objective.name", "parallel.tp_size"),
            f"objective={o.name} does not run under tensor parallelism: {REFUSED['tp']}. Use `parallel=fsdp`.",
        )
    if p.cp_size > 1:
        yield SpecError(
            ("objective.name", "parallel.cp_size"),
            f"objective={o.name} does not run under context parallel: {REFUSED['cp']}. Set parallel.cp_size=1 "
            "(long pairs: model.attention=varlen, train.loss_chunks, memory=selective).",
        )
    if spec.distill.teacher is not None:
        yield SpecError(
            ("objective.name", "distill.teacher"),
            "a preference objective and distillation are exclusive: set distill=none.",
        )
    if spec.memory.auto_micro_batch:
        yield SpecError(
            ("objective.name", "memory.auto_micro_batch"),
            f"the micro-batch search measures plain sequences, not objective={o.name}'s pairs and reference forward: "
            "set memory.auto_micro_batch=false and train.micro_batch_size (in pairs).",
        )
    if o.name == "kto" and o.reference == "precompute":
        yield SpecError(
            ("objective.reference",),
            "objective=kto needs the reference's log-probs of each batch's KL rows (prompts with another "
            "example's completion), which change with the batch: use objective.reference=model.",
        )
    needs_copy = o.name in NEEDS_REFERENCE and spec.quantization.lora.rank == 0
    if needs_copy and p.strategy == "deepspeed":
        yield SpecError(
            ("objective.name", "parallel.strategy"),
            f"objective={o.name} without LoRA needs a frozen reference copy, and DeepSpeed partitions only the model "
            "it wraps: add LoRA (quantization=lora or nf4_lora: the reference is the base, adapters off) or use "
            "`parallel=fsdp` (the reference is sharded like the model).",
        )


RULES: tuple[Rule, ...] = (_settings, _data, _placement)

"""Rules of context parallel (parallel.cp_size > 1: each sequence split over a group of ranks), checked before launch.

Context parallel composes with the strategies single (the cp group alone), ddp and fsdp, on the
built-in GPT: its attention gathers keys and values over the group (launcher.components.model.
context_parallel). Each rank keeps two of the 2 x cp_size equal chunks of a sequence, so data.seq_len
must divide by 2 x cp_size; the world size must be a multiple of cp_size times the other degrees
(launcher.parallel.dims says so for ddp and single here; launcher.rules.sharding for fsdp). What it
cannot run is refused with the reason: pipelines, DeepSpeed, tensor parallel, Hugging Face models,
FlexAttention and a distillation teacher.
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.parallel.dims import degree_errors
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, positive
from launcher.spec import RunSpec, SpecError

STRATEGIES = ("single", "ddp", "fsdp")
"""Strategies context parallel composes with (the cp ranks average gradients like data-parallel ones)."""
_WHY_NOT = {
    "deepspeed": "DeepSpeed's engine owns the model's forward and the gradient reduction over its own groups",
    "tp": "tensor parallel with context parallel is not built yet (each would split the attention a different way)",
    "pp": "a pipeline's stages exchange whole-sequence activations through torch's schedule",
}
FIX = "Use `parallel=fsdp`, `parallel=ddp` or `parallel=single` with parallel.cp_size, or parallel.cp_size=1."


def _cp(spec: RunSpec) -> int:
    return spec.parallel.cp_size


def _strategy(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    yield from positive("parallel.cp_size", p.cp_size, "1 turns context parallel off.")
    if _cp(spec) < 2:
        return
    if p.strategy not in STRATEGIES:
        why = _WHY_NOT.get(p.strategy, f"parallel.strategy={p.strategy} has no context-parallel path")
        yield SpecError(
            ("parallel.cp_size", "parallel.strategy"),
            f"parallel.cp_size={p.cp_size} splits each sequence over {p.cp_size} ranks, but "
            f"parallel.strategy={p.strategy} cannot run it: {why}. {FIX}",
        )
    for key, value, why in (
        ("parallel.pp_size", p.pp_size, _WHY_NOT["pp"]),
        ("parallel.tp_size", p.tp_size, _WHY_NOT["tp"]),
    ):
        if value > 1 and p.strategy in STRATEGIES:  # else refused above
            yield SpecError(
                ("parallel.cp_size", key),
                f"parallel.cp_size={p.cp_size} with {key}={value} is refused: {why}. Set {key}=1, or "
                "parallel.cp_size=1.",
            )
    if p.strategy in ("single", "ddp") and p.pp_size == 1:  # fsdp's degrees are launcher.rules.sharding's
        yield from degree_errors(p, spec.launcher.world_size)


def _sequence(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    cp, seq = _cp(spec), spec.data.seq_len
    if cp > 1 and seq % (2 * cp):
        fit = max(2 * cp, seq - seq % (2 * cp))
        yield SpecError(
            ("parallel.cp_size", "data.seq_len"),
            f"parallel.cp_size={cp} cuts each sequence into 2 x cp_size = {2 * cp} equal chunks (each rank keeps "
            f"one early and one late chunk, so causal attention costs every rank the same), but data.seq_len={seq} "
            f"does not divide by {2 * cp}. Use data.seq_len={fit}, or another parallel.cp_size.",
        )


def _model(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    cp, m = _cp(spec), spec.model
    if cp < 2:
        return
    if m.kind != "gpt":
        yield SpecError(
            ("parallel.cp_size", "model.kind"),
            f"parallel.cp_size={cp} runs the built-in GPT's attention over the gathered keys and values; "
            f"model.kind={m.kind} (a Hugging Face model) has its own attention, which has no context-parallel "
            "path. Use a built-in GPT (model=gpt_tiny, gpt_125m, ...), or parallel.cp_size=1 (long sequences of HF models: model.attention=varlen, "
            "train.loss_chunks, memory=selective).",
        )
    if m.attention == "flex":
        yield SpecError(
            ("parallel.cp_size", "model.attention"),
            f"parallel.cp_size={cp} computes each chunk's attention against the gathered keys with its own "
            "causal and document mask; model.attention=flex has no context-parallel path (and its backward runs "
            "on CUDA only). Use model.attention=auto, or parallel.cp_size=1.",
        )


def _techniques(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    cp = _cp(spec)
    if cp < 2:
        return
    if spec.distill.teacher:
        yield SpecError(
            ("parallel.cp_size", "distill.teacher"),
            f"a distillation teacher runs whole sequences, but under parallel.cp_size={cp} each rank holds only "
            "its chunks of them. Distill with parallel.cp_size=1.",
        )


RULES: tuple[Rule, ...] = (_strategy, _sequence, _model, _techniques)

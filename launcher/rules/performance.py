"""Rules of the memory, batching, compile and profiling options, checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.groups.batching import BATCHING
from launcher.groups.compile import MODES
from launcher.rules.core import Hardware, rule
from launcher.spec import RunSpec, SpecError, did_you_mean

SHARDING_STRATEGIES = ("fsdp", "tp")


def _unknown(key: str, value: str, choices: tuple[str, ...], what: str) -> Iterator[SpecError]:
    if value not in choices:
        yield SpecError(
            (key,),
            f"unknown {what} '{value}'.{did_you_mean(value, choices)} Choose one of: {', '.join(choices)}.",
        )


@rule
def _checkpointing(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m = spec.memory
    if m.checkpoint_every < 1:
        yield SpecError(
            ("memory.checkpoint_every",), f"must be 1 or more (1: every block), got {m.checkpoint_every}."
        )
    elif m.checkpoint_every != 1 and m.activation_checkpointing == "none":
        yield SpecError(
            ("memory.checkpoint_every", "memory.activation_checkpointing"),
            "checkpoint_every picks which blocks are checkpointed, but activation_checkpointing is none. "
            "Use `memory=checkpoint_every_2` (or activation_checkpointing=blocks), or drop checkpoint_every.",
        )
    if spec.model.kind != "gpt" and m.activation_checkpointing == "attention":
        yield SpecError(
            ("memory.activation_checkpointing", "model.kind"),
            f"model.kind={spec.model.kind} is checkpointed through the model's own switch, which recomputes "
            "whole layers; attention-only checkpointing exists for the built-in GPT only. Use "
            "`memory=checkpoint_all` (or checkpoint_every_2).",
        )
    if m.empty_cache_steps is not None and m.empty_cache_steps <= 0:
        yield SpecError(
            ("memory.empty_cache_steps",), "must be positive; use null to never empty the CUDA cache."
        )


@rule
def _auto_micro_batch(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m = spec.memory
    if m.max_memory_gb is not None and m.max_memory_gb <= 0:
        yield SpecError(("memory.max_memory_gb",), f"must be positive, got {m.max_memory_gb}.")
    if not m.auto_micro_batch:
        if m.max_memory_gb is not None:
            yield SpecError(
                ("memory.max_memory_gb", "memory.auto_micro_batch"),
                "max_memory_gb is the budget of the micro-batch search, which is off. Use `memory=auto_batch` "
                "(memory.auto_micro_batch=true), or drop max_memory_gb.",
            )
        return
    if m.max_micro_batch_size < 1:
        yield SpecError(("memory.max_micro_batch_size",), "must be 1 or more.")
    p = spec.parallel
    if (
        p.strategy in SHARDING_STRATEGIES
        or p.tp_size > 1
        or (p.strategy == "deepspeed" and p.zero_stage == 3)
    ):
        yield SpecError(
            ("memory.auto_micro_batch", "parallel.strategy"),
            f"the search measures the whole, unsharded model on one device, which overstates memory under "
            f"parallel.strategy={p.strategy} (zero_stage={p.zero_stage}, tp_size={p.tp_size}). Set "
            "train.micro_batch_size by hand (the dry run's memory plan helps), or search with parallel=ddp.",
        )
    if spec.data.batching == "token_budget":
        yield SpecError(
            ("memory.auto_micro_batch", "data.batching"),
            "token_budget batches size themselves by data.max_tokens_per_batch, so there is no micro batch "
            "to search. Turn one of them off.",
        )


@rule
def _batching(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.data
    yield from _unknown("data.batching", d.batching, BATCHING, "batching")
    if d.batching in ("group_by_length", "token_budget") and d.packing:
        yield SpecError(
            ("data.batching", "data.packing"),
            f"{d.batching} batches whole documents of different lengths, but packed sequences all hold "
            f"data.seq_len tokens. Add `data.packing=false`.",
        )
    if d.batching == "token_budget":
        if d.max_tokens_per_batch is None or d.max_tokens_per_batch < d.seq_len:
            yield SpecError(
                ("data.max_tokens_per_batch", "data.seq_len"),
                f"token_budget needs a budget of at least one sequence (data.seq_len={d.seq_len}) of padded "
                f"tokens per micro batch, got {d.max_tokens_per_batch}. E.g. data.max_tokens_per_batch={16 * d.seq_len}.",
            )
    elif d.max_tokens_per_batch is not None:
        yield SpecError(
            ("data.max_tokens_per_batch", "data.batching"),
            "max_tokens_per_batch is used by token_budget batching only. Add `data.batching=token_budget "
            "data.packing=false`, or drop it.",
        )


@rule
def _compile(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    c = spec.compile
    yield from _unknown("compile.mode", c.mode, MODES, "compile mode")
    if c.mode == "off" and (c.fullgraph or c.dynamic is not None):
        yield SpecError(
            ("compile.mode", "compile.fullgraph", "compile.dynamic"),
            "fullgraph and dynamic tune torch.compile, which is off. Pick a mode (e.g. `compile=default`) or "
            "drop them.",
        )
    if c.mode == "reduce-overhead" and hw.device_type != "cuda":
        yield SpecError(
            ("compile.mode",),
            f"reduce-overhead captures CUDA graphs, which do not exist on {hw.device_type}. Use `compile=default`.",
        )


@rule
def _profile(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.profiler
    for key, value, least in (("wait", p.wait, 0), ("warmup", p.warmup, 0), ("active", p.active, 1),
                              ("repeat", p.repeat, 0), ("top_ops", p.top_ops, 1)):  # fmt: skip
        if value < least:
            yield SpecError((f"profiler.{key}",), f"must be {least} or more, got {value}.")
    if spec.profile and spec.train.max_steps < p.steps_needed():
        yield SpecError(
            ("profile", "profiler.wait", "profiler.warmup", "profiler.active", "train.max_steps"),
            f"the profiler records after wait + warmup + active = {p.steps_needed()} steps, but the run has "
            f"{spec.train.max_steps}. Raise train.max_steps or lower the profiler's steps.",
        )

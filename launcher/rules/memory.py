"""Rules of the memory group: activation checkpointing, long sequences (attention path, chunked loss), the
automatic micro-batch search, fitting the GPU."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.components.memory import alloc_conf_problems
from launcher.components.model.long_context import parse_loss_chunks
from launcher.plan.fit import fixes, memory_error, too_large
from launcher.plan.planner import plan
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


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


def _long_sequences(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    attention = spec.model.attention
    if attention == "flex" and hw.device_type != "cuda":
        yield SpecError(
            ("model.attention",),
            f"flex: FlexAttention's backward runs on CUDA only (in torch 2.13), and this run trains on "
            f"{hw.device_type}. Use model.attention=varlen (per-document SDPA, every device) or auto.",
        )
    if attention == "flex" and spec.model.dropout > 0:
        yield SpecError(
            ("model.attention", "model.dropout"),
            "flex: FlexAttention has no attention dropout. Use model.attention=varlen, or model.dropout=0.",
        )
    try:
        parse_loss_chunks(spec.train.loss_chunks)
    except ValueError:
        yield SpecError(
            ("train.loss_chunks",),
            f"must be auto or a whole number >= 1 (1: whole logits), got {spec.train.loss_chunks!r}.",
        )
    m = spec.memory
    if m.selective_matmuls != "all" and m.activation_checkpointing != "selective":
        yield SpecError(
            ("memory.selective_matmuls", "memory.activation_checkpointing"),
            f"selective_matmuls picks what selective checkpointing saves, but activation_checkpointing is "
            f"{m.activation_checkpointing}. Use `memory=selective`, or drop selective_matmuls.",
        )


def _cuda_alloc_conf(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    conf = spec.memory.cuda_alloc_conf
    for problem in alloc_conf_problems(conf) if conf is not None else []:
        yield SpecError(
            ("memory.cuda_alloc_conf",),
            f"{problem}. It becomes PYTORCH_CUDA_ALLOC_CONF: comma-separated key:value pairs, "
            "quoted when it has several: 'memory.cuda_alloc_conf=\"expandable_segments:True,max_split_size_mb:256\"'.",
        )


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
    # FSDP2, ZeRO-3 and TP are searched as a step holds them, sharded (launcher.rank.micro_batch)
    if spec.data.batching == "token_budget":
        yield SpecError(
            ("memory.auto_micro_batch", "data.batching"),
            "token_budget batches size themselves by data.max_tokens_per_batch, so there is no micro batch "
            "to search. Turn one of them off.",
        )


def _fits_device(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """On a GPU, the planned memory per rank must fit the device's (launcher.plan.fit names the fixes)."""
    if hw.device_type != "cuda" or not hw.gpu_memory_bytes:
        return
    # pp is planned per pipeline stage; the micro-batch search finds what fits on the rank itself
    if spec.parallel.strategy == "pp" or spec.parallel.pp_size > 1 or spec.memory.auto_micro_batch:
        return
    try:
        memory = plan(spec, device_type="cuda")
    except (ValueError, OSError, KeyError):  # a model the planner cannot count: the model's rules say why
        return
    if too_large(memory, hw.gpu_memory_bytes):
        yield memory_error(memory, hw.gpu_memory_bytes, fixes(spec), hw.gpu_name if hw.requested else "")


RULES: tuple[Rule, ...] = (_checkpointing, _long_sequences, _cuda_alloc_conf, _auto_micro_batch, _fits_device)
"""This module's rules, in the order they report."""
